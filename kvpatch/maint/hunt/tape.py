"""A tape: the source lines a hunt runs, executed as they are recorded, so that what the hunt observed and the
reproduction it writes are the same program. Runs inside a bucket (imports upstream when a tape starts).
"""

from __future__ import annotations

import ast
import inspect
import re
from functools import cache
from pathlib import Path
from typing import Any

from .targets import Target

SCAFFOLD = Path(__file__).with_name("scaffold.py")
#: The line that starts a probe: one more step on copies of the cache and its rows (machine.py writes it,
#: repro.py turns it into a step on the cache itself).
PROBE = "probe, probe_rows = copy.deepcopy((cache, rows))"


@cache
def scaffold_functions() -> dict[str, str]:
    """The scaffold's functions by name, as source text."""
    text = SCAFFOLD.read_text(encoding="utf-8")
    tree = ast.parse(text)
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = ast.get_source_segment(text, node) or ""
    return out


def list_form_mask(base: str) -> bool:
    """True where the distribution's ``create_attention_mask`` takes the layer's cache list (mlx-lm <= 0.24)."""
    import importlib

    source = inspect.getsource(importlib.import_module(base).create_attention_mask)
    return "cache[0]" in source


def header(target: Target, *, extra_imports: tuple[str, ...] = ()) -> list[str]:
    """The import lines and ``mask_for`` of a tape over ``target``."""
    names = [target.name] + ([target.single] if target.single and target.single_module == target.module else [])
    lines = ["import copy", "", "import mlx.core as mx"]
    if target.kind != "arrays":
        lines.append(f"from {target.base} import create_attention_mask, scaled_dot_product_attention")
    lines.append(f"from {target.module} import {', '.join(dict.fromkeys(names))}")
    if target.single and target.single_module != target.module:
        lines.append(f"from {target.single_module} import {target.single}")
    lines.extend(extra_imports)
    if target.kind != "arrays":
        cache_arg = "[cache]" if list_form_mask(target.base) else "cache"
        lines += [
            "",
            "",
            "def mask_for(cache, n):",
            '    """The mask a model builds for n new tokens (upstream\'s create_attention_mask)."""',
            f"    return create_attention_mask(mx.zeros((1, n, 1)), {cache_arg})",
        ]
    return lines


class Tape:
    """Source lines executed in one namespace as they are recorded."""

    def __init__(self, head: list[str]) -> None:
        self.head = head
        self.lines: list[str] = []
        self.ns: dict[str, Any] = {"__name__": "__hunt__"}
        functions = scaffold_functions()
        exec(compile("\n".join([*head, "", *functions.values()]), "<hunt>", "exec"), self.ns)

    def run(self, line: str) -> None:
        """Record ``line`` and execute it (an exception is upstream's answer: the caller judges it)."""
        self.lines.append(line)
        exec(compile(line, "<hunt>", "exec"), self.ns)

    def value(self, expression: str) -> Any:
        return eval(compile(expression, "<hunt>", "eval"), self.ns)


def used(lines: list[str]) -> list[str]:
    """The scaffold functions that ``lines`` call, with what those call, in the scaffold's order."""
    functions = scaffold_functions()
    text = "\n".join(lines)
    wanted: list[str] = []
    frontier = [n for n in functions if _calls(text, n)]
    while frontier:
        name = frontier.pop()
        if name in wanted:
            continue
        wanted.append(name)
        frontier.extend(n for n in functions if n not in wanted and _calls(functions[name], n))
    return [n for n in functions if n in wanted]


def _calls(text: str, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\(", text) is not None
