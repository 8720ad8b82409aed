"""The native kernels' C signatures against their one declaration on the
Python side (executor_svc/native_signatures.py), from which the ctypes
bindings are built; and PAGEDSERVE_NATIVE=require turning a failed build into
an error. Parsing only, plus one tiny compile: no kernel runs here."""

from __future__ import annotations

import ctypes
import glob
import os
import re

import pytest

from executor_svc import native_build
from executor_svc.native_signatures import SIGNATURES, Signature, bind, parse

PACKAGE = os.path.dirname(os.path.abspath(native_build.__file__))
SOURCES = sorted(
    os.path.relpath(p, PACKAGE)
    for pattern in ("native/*.c", "attention/native/*.c")
    for p in glob.glob(os.path.join(PACKAGE, pattern))
)

# A definition at the start of a line that is not static (nor a typedef):
# its return type, name and parameters, up to the opening brace.
_DEFINITION = re.compile(r"^(?!static\b|typedef\b)([A-Za-z_][\w \t\*]*?\b\w+\s*\([^)]*\))\s*\{", re.MULTILINE)


def exported_definitions(c_code: str) -> list[Signature]:
    """Every non-static function defined in `c_code` (each #if branch's alike)."""
    code = re.sub(r"/\*.*?\*/|//[^\n]*", " ", c_code, flags=re.DOTALL)
    return [parse(m.group(1)) for m in _DEFINITION.finditer(code)]


def mismatches(c_code: str, declared: tuple[str, ...]) -> list[str]:
    table = {sig.name: sig for sig in map(parse, declared)}
    problems, seen = [], set()
    for sig in exported_definitions(c_code):
        seen.add(sig.name)
        if sig.name not in table:
            problems.append(f"{sig.name}: defined in C, not declared in native_signatures.py")
        elif sig != table[sig.name]:
            problems.append(f"{sig.name}: C has {sig}, native_signatures.py has {table[sig.name]}")
    problems += [f"{name}: declared, not defined in C" for name in table if name not in seen]
    return problems


def test_every_native_source_has_a_declaration():
    assert SOURCES and set(SOURCES) == set(SIGNATURES)


@pytest.mark.parametrize("source", SOURCES)
def test_c_definitions_match_the_declared_signatures(source):
    with open(os.path.join(PACKAGE, source)) as f:
        code = f.read()
    assert exported_definitions(code), f"found no exported function in {source}"
    assert mismatches(code, SIGNATURES[source]) == []


def test_a_drifted_parameter_is_caught():
    declared = SIGNATURES["native/fused_ops.c"]
    with open(os.path.join(PACKAGE, "native/fused_ops.c")) as f:
        code = f.read()
    # A new argument in C only; two arguments swapped; a type narrowed; a function dropped from the table.
    assert mismatches(
        code.replace("int rows, int cols, int num_threads)", "int rows, int cols, int k, int num_threads)"), declared
    )
    assert mismatches(code.replace("int rows, int inter,", "int inter, int rows,"), declared)
    assert mismatches(code.replace("int64_t ld_x, int rows, int cols", "int ld_x, int rows, int cols"), declared)
    assert mismatches(code, declared[1:])


def test_bindings_are_built_from_the_declarations():
    class Lib:
        def __init__(self):
            self.fns = {}

        def __getattr__(self, name):
            return self.fns.setdefault(name, type("Fn", (), {})())

    lib = bind(Lib(), "native/fused_ops.c")
    norm = lib.fns["rms_norm_f32"]
    assert norm.restype is None and len(norm.argtypes) == 11
    assert norm.argtypes[:2] == [ctypes.c_void_p, ctypes.c_int64] and norm.argtypes[9] is ctypes.c_float
    assert lib.fns["argmax_rows_f32"].restype is ctypes.c_int


def test_require_mode_comes_from_the_environment_once():
    assert native_build.native_required({}) is False
    assert native_build.native_required({"PAGEDSERVE_NATIVE": "auto"}) is False
    assert native_build.native_required({"PAGEDSERVE_NATIVE": "require"}) is True
    with pytest.raises(ValueError, match="expected 'auto' or 'require'"):
        native_build.native_required({"PAGEDSERVE_NATIVE": "yes"})


@pytest.mark.parametrize("required", [False, True])
def test_a_failed_build_falls_back_or_raises_under_require(tmp_path, monkeypatch, required):
    broken = tmp_path / "broken.c"
    broken.write_text("int broken(void) { return }\n")
    monkeypatch.setattr(native_build, "REQUIRED", required)
    if required:
        with pytest.raises(native_build.NativeBuildError, match="PAGEDSERVE_NATIVE=require.*broken"):
            native_build.load_library(str(broken))
    else:
        assert native_build.load_library(str(broken)) is None


def test_prebuild_compiles_side_by_side_and_load_library_finds_them(tmp_path, monkeypatch):
    """A first start compiles every kernel at once (native_build.prebuild);
    load_library then loads what is in the cache without compiling, and a
    source that does not build is reported there, not by prebuild."""
    from executor_svc import decoder_stack, fused_ops

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(native_build, "REQUIRED", True)
    broken = tmp_path / "broken.c"
    broken.write_text("int broken(void) { return }\n")
    compiles = []
    real_run = native_build.subprocess.run

    def counting_run(cmd, **kw):
        compiles.append(os.path.basename(cmd[-4]))
        return real_run(cmd, **kw)

    monkeypatch.setattr(native_build.subprocess, "run", counting_run)
    native_build.prebuild([(fused_ops.SOURCE, ()), (decoder_stack.SOURCE, ()), (str(broken), ())])  # left for later
    assert sorted(compiles) == ["broken.c", "decoder_stack.c", "fused_ops.c"]
    assert len(glob.glob(str(tmp_path / "cache" / "pagedserve" / "native" / "*.so"))) == 2
    assert native_build.load_library(fused_ops.SOURCE) is not None
    assert native_build.load_library(decoder_stack.SOURCE) is not None
    assert len(compiles) == 3, "load_library should have found both in the cache"
    with pytest.raises(native_build.NativeBuildError, match="broken"):
        native_build.load_library(str(broken))
