"""Compiles a native C source with the system compiler and loads it via ctypes.

Each library is built once per version of its source and the local headers
it includes, flags and CPU (-march=native) and reused; ctypes releases the GIL
for every call. Its functions' argument and result types come from
native_signatures.py, the one declaration of each C signature on the Python
side.

The kernels need a C compiler with OpenMP (gcc). Without one, when the build
fails or when the cache is not private, `load_library` logs a warning and
returns None, and the caller falls back to plain torch: slower, same
results. PAGEDSERVE_NATIVE=require (read once, when this module is first
imported; CI sets it) turns that into a NativeBuildError instead, so a
broken kernel cannot pass as a fallback.

The cache is this user's own: $XDG_CACHE_HOME/pagedserve/native (by default
~/.cache/pagedserve/native), created 0700 and refused when it is owned by
someone else or open to group or others (shared/private_dir.py). A shared
library is code this process runs: a directory another user can write to, a
predictable /tmp path above all, would let them plant one.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import structlog

from executor_svc.native_signatures import SIGNATURES, bind
from shared.private_dir import ensure_private_dir

log = structlog.get_logger(__name__)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
ENV_VAR = "PAGEDSERVE_NATIVE"


class NativeBuildError(RuntimeError):
    """A native kernel could not be built while PAGEDSERVE_NATIVE=require."""


def native_required(environ: Mapping[str, str]) -> bool:
    """PAGEDSERVE_NATIVE: "auto" (default: fall back to torch) or "require"."""
    mode = environ.get(ENV_VAR, "auto") or "auto"
    if mode not in ("auto", "require"):
        raise ValueError(f"{ENV_VAR}={mode!r}: expected 'auto' or 'require'")
    return mode == "require"


REQUIRED = native_required(os.environ)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        line = ""
    return frozenset(line.partition(":")[2].split())


def _cpu_signature() -> str:
    return platform.machine() + " ".join(sorted(cpu_flags()))


def cache_dir() -> str:
    """Where compiled kernels live (not yet checked: see load_library). Read at
    each call, like the temp dir it replaces: kernels load lazily, deep below
    any configuration."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pagedserve", "native")


def _source_and_headers(source: str) -> bytes:
    """The source's bytes followed by those of every local header it includes
    (`#include "..."`, recursively), so editing a header changes the build key."""
    seen: set[str] = set()

    def read(path: str) -> bytes:
        path = os.path.normpath(path)
        if path in seen:
            return b""
        seen.add(path)
        try:
            with open(path, "rb") as f:
                code = f.read()
        except OSError:  # not beside its includer (found through -I, or in a dead #if): key on the name
            return path.encode()
        headers = re.findall(rb'^\s*#\s*include\s+"([^"]+)"', code, flags=re.MULTILINE)
        return code + b"".join(read(os.path.join(os.path.dirname(path), h.decode())) for h in headers)

    return read(source)


def build_key(source: str, extra_flags: tuple[str, ...] = ()) -> str:
    """What a build of `source` depends on (its code and headers, flags, CPU),
    hashed: the compiled library's name, and a key for anything measured on it."""
    code = _source_and_headers(source)
    flags = " ".join([*FLAGS, *extra_flags])
    return hashlib.sha256(code + flags.encode() + _cpu_signature().encode()).hexdigest()[:16]


def _unavailable(stem: str, reason: str, stderr: str = "") -> None:
    if REQUIRED:
        raise NativeBuildError(f"{ENV_VAR}=require: the native kernel {stem} cannot be built: {reason}\n{stderr}")
    log.warning("native_build_unavailable", source=stem, reason=reason, **({"stderr": stderr} if stderr else {}))


def _build(source: str, extra_flags: tuple[str, ...]) -> tuple[str | None, str, str]:
    """(path of the built library or None, why not, the compiler's stderr):
    compiled into the cache unless a build of this key is there."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler on PATH", ""
    stem = os.path.splitext(os.path.basename(source))[0]
    key = build_key(source, extra_flags)
    try:
        folder = ensure_private_dir(cache_dir())
    except OSError as e:  # NotPrivateError is one: owned by another user, or open to others
        return None, f"kernel cache refused: {e}", ""
    lib_path = os.path.join(folder, f"{stem}-{key}.so")
    if not os.path.exists(lib_path):
        tmp = f"{lib_path}.{os.getpid()}.{threading.get_ident()}.tmp"
        flags = [*FLAGS, *extra_flags]
        done = subprocess.run([compiler, *flags, source, "-o", tmp, "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            return None, "compile failed", done.stderr[-2000:]
        os.replace(tmp, lib_path)  # atomic: concurrent builders never load a half-written file
    return lib_path, "", ""


def prebuild(builds: Iterable[tuple[str, tuple[str, ...]]]) -> None:
    """Compiles the (source, extra flags) builds not yet in the cache side by
    side, one compiler per core, in the order given (the slowest first), so
    that a first start waits for the slowest build instead of their sum;
    load_library then finds them built. Failures are left for load_library
    to report when its caller asks."""
    todo = list(builds)
    with ThreadPoolExecutor(max_workers=max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        list(pool.map(lambda build: _build(*build), todo))


def load_library(source: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled `source` as a loaded library with its declared functions
    bound (native_signatures.py), or None if it cannot be built here (a
    NativeBuildError under PAGEDSERVE_NATIVE=require)."""
    lib_path, reason, stderr = _build(source, extra_flags)
    if lib_path is None:
        return _unavailable(os.path.splitext(os.path.basename(source))[0], reason, stderr)
    lib = ctypes.CDLL(lib_path)
    key = os.path.relpath(os.path.abspath(source), _PACKAGE_DIR)
    return bind(lib, key) if key in SIGNATURES else lib
