"""Upstream source read as text, never imported: a module's file under a layer (or any root), and the definition of
a dotted name in a module's source. ``scripts/record_fingerprints.py`` fingerprints targets from it where a release
cannot be imported, and ``python -m kvpatch.maint.new`` reads a target's signature from it."""

from __future__ import annotations

import ast
from pathlib import Path

__all__ = ["definition", "module_file"]


def module_file(root: Path, module: str) -> Path | None:
    """The file of ``module`` (``mlx_lm.models.cache``) under ``root`` (a layer's directory), or None."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _defs(body: list[ast.stmt]) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for node in body:  # the last definition wins, as when the module runs
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
    return out


def definition(source: str, qualname: str) -> ast.AST | None:
    """The ``def`` or ``class`` node of ``qualname`` in ``source`` (a method is looked up through the bases defined in
    the same module, as attribute lookup would find it); None when ``source`` does not define it or does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    top = _defs(tree.body)

    def find(scope: dict[str, ast.AST], names: list[str], seen: set[str]) -> ast.AST | None:
        node = scope.get(names[0])
        if node is None or len(names) == 1:
            return node
        if not isinstance(node, ast.ClassDef) or node.name in seen:
            return None
        found = find(_defs(node.body), names[1:], seen | {node.name})
        if found is not None:
            return found
        for base in node.bases:  # inherited from a class of the same module
            if isinstance(base, ast.Name):
                found = find(top, [base.id, *names[1:]], seen | {node.name})
                if found is not None:
                    return found
        return None

    return find(top, qualname.split("."), set())
