"""Compiles every native kernel the installed executor_svc ships, for this CPU,
so that an image's first start skips the compile.

    python prebuild_kernels.py [--owner USER]

executor_svc/native_build.py keys each build on its source, flags and CPU
flags, so a kernel built here is reused only on the same kind of CPU; on
another the executor compiles its own at first use (the image keeps gcc).
The loader writes beside the sources only when it may, so --owner hands the
build folders to the user the image runs as.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys

import executor_svc
from executor_svc.attention import native_kernel
from executor_svc.native_build import cpu_flags, load_library


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--owner", default="", help="User to own the build folders.")
    a = p.parse_args()
    root = os.path.dirname(executor_svc.__file__)
    sources = sorted(glob.glob(os.path.join(root, "**", "native", "*.c"), recursive=True))
    assert sources, f"no native sources under {root}: the wheel lost its package data"
    builds = [(s, ()) for s in sources]
    if "avx512_bf16" in cpu_flags():  # a bf16 model's first start would time the decode dot route
        builds.append((native_kernel.SOURCE, native_kernel.DOT_FLAGS))
    failed = [s for s, flags in builds if load_library(s, flags) is None]
    for folder in {os.path.join(os.path.dirname(s), "build") for s in sources}:
        if a.owner and os.path.isdir(folder):
            for path in [folder, *glob.glob(os.path.join(folder, "*"))]:
                shutil.chown(path, a.owner, a.owner)
    print(f"prebuilt {len(builds) - len(failed)}/{len(builds)} native kernel builds", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
