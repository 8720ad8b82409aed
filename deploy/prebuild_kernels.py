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
from executor_svc.native_build import load_library


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--owner", default="", help="User to own the build folders.")
    a = p.parse_args()
    root = os.path.dirname(executor_svc.__file__)
    sources = sorted(glob.glob(os.path.join(root, "**", "native", "*.c"), recursive=True))
    assert sources, f"no native sources under {root}: the wheel lost its package data"
    failed = [s for s in sources if load_library(s) is None]
    for folder in {os.path.join(os.path.dirname(s), "build") for s in sources}:
        if a.owner and os.path.isdir(folder):
            for path in [folder, *glob.glob(os.path.join(folder, "*"))]:
                shutil.chown(path, a.owner, a.owner)
    print(f"prebuilt {len(sources) - len(failed)}/{len(sources)} native kernels", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
