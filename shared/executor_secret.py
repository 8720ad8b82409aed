"""The secret the scheduler presents to its executor.

Either the operator names one (--auth-token-file on the executor,
--executor-auth-token-file on the scheduler), or both processes use this
installation's own: a random secret generated on first start in a private
per-user directory, so `make run`, `pagedserve serve` and compose (which
shares the directory through a volume) need no configuration, yet no other
local user can drive the executor. The directory is --secret-dir, by default
$XDG_STATE_HOME/pagedserve (~/.local/state/pagedserve):

    ~/.local/state/pagedserve/          0700, this user's
        executor-secret                 0600, 43 url-safe characters (256 bits)

Two processes that start at once agree on one secret: each writes a complete
candidate under a name of its own and links it to `executor-secret`; the link
fails for all but the first, and everyone reads the winner. Everything is
opened relative to the checked directory with O_NOFOLLOW, so a path swapped
after the check is never followed.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping

from shared.private_dir import NotPrivateError, check_private, ensure_private_dir

SECRET_FILE = "executor-secret"


def default_secret_dir(environ: Mapping[str, str]) -> str:
    state = environ.get("XDG_STATE_HOME") or os.path.join(
        environ.get("HOME") or os.path.expanduser("~"), ".local", "state"
    )
    return os.path.join(state, "pagedserve")


def read_secret_file(path: str) -> str:
    """An operator's secret file: one token on one line; blank and `#` lines are skipped.

    The executor (--auth-token-file) and the scheduler (--executor-auth-token-file)
    both read the shared file through here, so they cannot disagree on the secret.
    Empty is an error, never "no secret".
    """
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f]
    lines = [line for line in lines if line and not line.startswith("#")]
    if not lines:
        raise ValueError(f"{path} holds no secret (it is empty, or only blank and # lines)")
    if len(lines) > 1 or len(lines[0].split()) != 1:
        raise ValueError(f"{path}: expected exactly one token on one line")
    return lines[0]


def installation_secret(directory: str) -> str:
    """This installation's secret in `directory`, generated there on first use."""
    directory = ensure_private_dir(directory)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        check_private(os.fstat(dir_fd), directory, "directory")  # the one we opened, not just the one we checked
        try:
            return _read(dir_fd, directory)
        except FileNotFoundError:
            _create(dir_fd)
        return _read(dir_fd, directory)
    finally:
        os.close(dir_fd)


def _read(dir_fd: int, directory: str) -> str:
    path = os.path.join(directory, SECRET_FILE)
    try:
        fd = os.open(SECRET_FILE, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise NotPrivateError(f"{path} cannot be opened ({e.strerror}): remove it") from e
    with os.fdopen(fd, encoding="ascii") as f:
        check_private(os.fstat(f.fileno()), path, "file")
        secret = f.read().strip()
    if len(secret) < 32:
        raise NotPrivateError(f"{path} holds no usable secret: remove it and restart both services")
    return secret


def _create(dir_fd: int) -> None:
    candidate = f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(candidate, SECRET_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        except FileExistsError:
            pass  # another process won the race: its secret is the one
    finally:
        os.unlink(candidate, dir_fd=dir_fd)
