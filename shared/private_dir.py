"""Directories and files only their owner can reach: where secrets and compiled
code live.

A path that another local user can write to (or owns) can be swapped for
something of theirs: a secret they know, a shared library they wrote. So these
helpers create what is missing as private (0700 directories, 0600 files) and
refuse, with an error that says how to fix it, anything that exists but is a
symbolic link, is owned by another uid, or is open to group or others. Root is
no exception: a root process must not trust another user's directory either.
"""

from __future__ import annotations

import os
import stat


class NotPrivateError(PermissionError):
    """A directory or file that should be its owner's alone is not."""


def check_private(st: os.stat_result, path: str, kind: str) -> None:
    """Raises NotPrivateError unless `st` (an lstat/fstat result) is a `kind`
    ("directory" or "file") of this process's user with no group/other bits."""
    is_kind = stat.S_ISDIR(st.st_mode) if kind == "directory" else stat.S_ISREG(st.st_mode)
    if stat.S_ISLNK(st.st_mode) or not is_kind:
        raise NotPrivateError(f"{path} is not a {kind} (a symbolic link or something else): remove it")
    if st.st_uid != os.geteuid():
        raise NotPrivateError(
            f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): use a path of your own"
        )
    if st.st_mode & 0o077:
        fix = "chmod 700" if kind == "directory" else "chmod 600"
        raise NotPrivateError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):o}: group or others can reach it ({fix} {path}, or remove it)"
        )


def ensure_private_dir(path: str) -> str:
    """Creates `path` (mode 0700) if missing, then checks it is private; returns it absolute.

    Missing parents are created 0700 as well; existing parents are left as
    they are (a home directory's mode is its owner's business).
    """
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        os.mkdir(path, 0o700)  # the umask can only take bits away
    except FileExistsError:
        pass
    check_private(os.lstat(path), path, "directory")
    return path
