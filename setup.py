"""Build hook: the gRPC/protobuf modules are generated from protos/ when the
wheel is built, never committed (everything else is declared in pyproject.toml).

Generated code checks at import time that the installed runtime is at least
the generator's version (protobuf's ValidateProtobufRuntimeVersion, grpc's
GRPC_GENERATED_VERSION), so the wheel's grpcio/protobuf floors are read from
the code this build generated rather than written by hand: a wheel built with
a newer grpcio-tools asks for a newer runtime instead of failing at import.
"""

from __future__ import annotations

import atexit
import functools
import importlib.resources
import os
import re
import shutil
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTOS = ("pagedserve/v1/generation.proto", "pagedserve/executor/v1/executor.proto")


@functools.lru_cache(maxsize=1)
def generated() -> str:
    """A temp folder holding pagedserve/**/*_pb2*.py{,i}, generated once per build."""
    from grpc_tools import protoc  # a build requirement (pyproject [build-system])

    out = tempfile.mkdtemp(prefix="pagedserve-protos-")
    atexit.register(shutil.rmtree, out, True)
    include = str(importlib.resources.files("grpc_tools") / "_proto")  # google/protobuf/*.proto
    args = [
        "protoc",
        "-I",
        os.path.join(HERE, "protos"),
        "-I",
        include,
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--pyi_out={out}",
        *PROTOS,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {', '.join(PROTOS)}")
    return out


def runtime_requirements() -> list[str]:
    """The client's dependencies, with floors the generated code demands."""
    folder = os.path.join(generated(), "pagedserve", "v1")
    with open(os.path.join(folder, "generation_pb2.py"), encoding="utf-8") as f:
        protobuf = re.search(r"^# Protobuf Python Version: (\d+)\.(\d+)\.(\d+)", f.read(), re.MULTILINE)
    with open(os.path.join(folder, "generation_pb2_grpc.py"), encoding="utf-8") as f:
        grpc = re.search(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'", f.read(), re.MULTILINE)
    assert protobuf and grpc, "the generated code's version stamps moved; update setup.py"
    major = int(protobuf.group(1))
    return [
        f"grpcio>={grpc.group(1)}",
        f"grpcio-health-checking>={grpc.group(1)}",  # the CLI's `health` and every service's health check
        f"grpcio-status>={grpc.group(1)}",  # rich error details (BadRequest field violations)
        # protobuf accepts gencode of its own major version only (one older with a warning)
        f"protobuf>={protobuf.group(1)}.{protobuf.group(2)}.{protobuf.group(3)},<{major + 1}",
    ]


class BuildPyWithProtos(build_py):
    """Adds the generated modules to the wheel; for an editable install (whose
    import path is the checkout) writes them into the checkout, as `make protos` does."""

    def run(self) -> None:
        super().run()
        target = HERE if self.editable_mode else self.build_lib
        for folder, _, files in os.walk(os.path.join(generated(), "pagedserve")):
            rel = os.path.relpath(folder, generated())
            os.makedirs(os.path.join(target, rel), exist_ok=True)
            for name in files:
                shutil.copyfile(os.path.join(folder, name), os.path.join(target, rel, name))


setup(cmdclass={"build_py": BuildPyWithProtos}, install_requires=runtime_requirements())
