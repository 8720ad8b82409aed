#!/usr/bin/env python3
"""Prints the import cycles among the project's own modules; exits 1 if there is one.

    python tools/import_cycles.py [PACKAGE ...]      (from the repository root)

Default packages: every top-level folder with an __init__.py except tests.
Imports under `if TYPE_CHECKING:` do not count (they never run); a deferred
import inside a function does: it hides a cycle, it does not remove it.
A cycle is a strongly connected component of the import graph (Tarjan).
"""

from __future__ import annotations

import ast
import os
import sys


def modules(packages: list[str]) -> dict[str, str]:
    """Module name -> file path, for every .py file under the packages."""
    out = {}
    for pkg in packages:
        for root, _, files in os.walk(pkg):
            for f in files:
                if f.endswith(".py"):
                    mod = os.path.join(root, f)[:-3].replace(os.sep, ".")
                    out[mod.removesuffix(".__init__")] = os.path.join(root, f)
    return out


def imports(path: str, mod: str, known: dict[str, str]) -> set[str]:
    """The known modules that `mod` (at `path`) imports at run time."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    type_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(n) for b in node.body for n in ast.walk(b))
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = mod.split(".")
                if not path.endswith("__init__.py"):
                    parts = parts[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            # A package's __init__ importing its own submodules is no cycle.
            if name and name != mod and not (path.endswith("__init__.py") and name.startswith(mod + ".")):
                found.add(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main(argv: list[str]) -> int:
    packages = argv or sorted(
        d for d in os.listdir(".") if os.path.isfile(os.path.join(d, "__init__.py")) and d != "tests"
    )
    known = modules(packages)
    found = cycles({m: imports(p, m, known) for m, p in known.items()})
    for component in found:
        print("import cycle: " + " <-> ".join(component))
    if not found:
        print(f"no import cycles among {len(known)} modules in {', '.join(packages)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
