"""tools/import_cycles.py (run by `make lint`): it finds a cycle, ignores
type-only imports, and finds none in the project."""

from __future__ import annotations

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import import_cycles  # noqa: E402


def write(root, files: dict[str, str]) -> None:
    for path, code in files.items():
        full = root / path
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_text(code)


@pytest.mark.parametrize(
    ("b_imports_a", "cycle"),
    [
        ("from pkg.a import X\n", True),
        ("def f():\n    from pkg import a  # deferred: still a cycle\n", True),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import X\n", False),
        ("from . import c\n", False),
    ],
)
def test_cycles_through_runtime_imports_only(tmp_path, monkeypatch, b_imports_a, cycle):
    write(
        tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from pkg.b import Y\n", "pkg/b.py": b_imports_a, "pkg/c.py": ""}
    )
    monkeypatch.chdir(tmp_path)
    known = import_cycles.modules(["pkg"])
    found = import_cycles.cycles({m: import_cycles.imports(p, m, known) for m, p in known.items()})
    assert found == ([["pkg.a", "pkg.b"]] if cycle else [])


def test_the_project_has_no_import_cycles(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert import_cycles.main([]) == 0, capsys.readouterr().out
