#!/usr/bin/env python3
"""The package's layering rules, checked from the source (no imports run):

1. lmcache_fx/core/ imports neither torch nor lmcache (nor any lmcache_fx
   module outside core/, except the C extension _fxio).
2. No import cycles between lmcache_fx modules, function-level imports
   included.
3. The tools import torch and LMCache only inside functions (so the commands
   start without them); the adapters and integration/ may import them.
4. Nothing shipped imports the tests.

Usage: check_layers.py [PACKAGE_DIR]   (default: lmcache_fx next to this script)
Prints one line per violation; exit status 1 when there is any.
"""

from __future__ import annotations

import ast
import os
import sys

HEAVY = ("torch", "lmcache", "vllm", "numpy")


def module_name(pkg_dir: str, path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(pkg_dir))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> list[str]:
    """Absolute module names an ImportFrom brings in (a name may be a submodule)."""
    if node.level == 0:
        base = node.module or ""
    else:
        parts = mod.split(".")
        keep = len(parts) - node.level + (1 if is_pkg else 0)
        base = ".".join(parts[:keep] + ([node.module] if node.module else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def imports(pkg_dir: str, path: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, at top level) for every import in a file."""
    mod = module_name(pkg_dir, path)
    is_pkg = path.endswith("__init__.py")
    tree = ast.parse(open(path).read(), path)
    out = []
    top = set(id(n) for n in tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += [(m, node.lineno, id(node) in top) for m in resolve(mod, is_pkg, node)]
    # imports under `if TYPE_CHECKING:` never run
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip = {n.lineno for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
            out = [x for x in out if x[1] not in skip]
    # imports at module level inside try/if blocks still run at import
    for node in tree.body:
        if isinstance(node, (ast.Try, ast.If)):
            lines = {n.lineno for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
            out = [(m, ln, top_ or ln in lines) for m, ln, top_ in out]
    return out


def check(pkg_dir: str) -> list[str]:
    pkg = os.path.basename(os.path.abspath(pkg_dir))
    files = {}
    for dirpath, _, names in os.walk(pkg_dir):
        for n in names:
            if n.endswith(".py"):
                p = os.path.join(dirpath, n)
                files[module_name(pkg_dir, p)] = p
    problems = []
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in sorted(files.items()):
        rel = os.path.relpath(path, os.path.dirname(pkg_dir))
        layer = mod.split(".")[1] if mod.count(".") >= 1 else ""
        found = imports(pkg_dir, path)
        for imp, line, top in found:
            root = imp.split(".")[0]
            internal = imp.startswith(pkg + ".") or imp == pkg
            if internal:
                target = imp if imp in files else imp.rsplit(".", 1)[0]
                # `from . import sub` names a submodule: the edge goes to it, not to the package
                names_submodules = any(other.startswith(imp + ".") and other in files for other, _, _ in found)
                if target in files and target != mod and not (target == imp and names_submodules):
                    graph[mod].add(target)
            if layer == "core":
                if root in HEAVY:
                    problems.append(f"{rel}:{line}: core imports {imp} (core must import neither torch nor LMCache)")
                elif internal and not (imp.startswith(f"{pkg}.core") or imp == f"{pkg}._fxio" or imp == pkg):
                    problems.append(f"{rel}:{line}: core imports {imp} (core depends only on core and _fxio)")
            if layer == "tools" and top and root in HEAVY:
                problems.append(
                    f"{rel}:{line}: tools import {imp} at module level (commands must start without "
                    "torch or LMCache: import it inside the function that needs it)"
                )
            if root == "tests" or root == "conftest":
                problems.append(f"{rel}:{line}: shipped code imports the tests ({imp})")
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp) + [sorted(comp)[0]])

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main(argv: list[str]) -> int:
    pkg_dir = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lmcache_fx")
    problems = check(os.path.normpath(pkg_dir))
    for p in problems:
        print(p)
    if not problems:
        print(f"layers: ok ({os.path.normpath(pkg_dir)})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
