"""A finding's reproduction: the shrunk tape as a self-contained script that imports mlx and one upstream only, ready
to paste into upstream's tracker. It exits 0 where the invariant holds and fails (an AssertionError, or upstream's
own exception for a crash) where it does not.
"""

from __future__ import annotations

import re

from .invariants import INVARIANTS
from .machine import Caught
from .tape import PROBE, scaffold_functions, used


def body(caught: Caught) -> list[str]:
    """The tape (with the lines a check needs before the last operation) and the check."""
    v = caught.violation
    lines = list(caught.lines)
    # The probe (one more step on copies of the cache and its rows) is a reproduction's last step: it runs on the
    # cache itself there (a copy can fail where the cache works: a patched class, a codec object).
    if PROBE in lines:
        at = lines.index(PROBE)
        rest = [re.sub(r"\bprobe_rows\b", "rows", re.sub(r"\bprobe\b", "cache", line)) for line in lines[at + 1 :]]
        lines = lines[:at] + rest
    if v.before:
        lines = lines[:-1] + v.before + lines[-1:]
    return lines + v.check


def script(caught: Caught, where: str) -> str:
    """The reproduction of ``caught``; ``where`` names the releases it was found on (e.g. ``mlx-lm 0.31.3``)."""
    v = caught.violation
    code = body(caught)
    head = [line for line in caught.head if not (line == "import copy" and not any("copy." in c for c in code))]
    helpers = [scaffold_functions()[name] for name in used(code)]
    if not any("attend(" in h or "attend(" in c for h in helpers for c in code):
        head = _without_mask(head)
    statement = INVARIANTS[v.invariant].statement
    out = [
        f"# {v.target}: {statement}.",
        f"# Found by kvpatch's bug hunt on {where}: {v.invariant} fails after {v.operation}: {_first(v.detail)}",
        *head,
    ]
    for helper in helpers:
        out += ["", "", helper]
    out += ["", "", *code]
    return "\n".join(_tidy(out)) + "\n"


def _first(text: str) -> str:
    """A message's first line (an exception's message may hold more), as a comment may hold it."""
    line = (text.strip().splitlines() or [""])[0]
    return line if len(line) <= 200 else line[:197] + "..."


def _without_mask(head: list[str]) -> list[str]:
    """The header without ``mask_for`` and the attention imports (a reproduction that never attends)."""
    out = []
    skip = False
    for line in head:
        if line.startswith("def mask_for"):
            skip = True
            continue
        if skip and (line.startswith("    ") or not line):
            continue
        skip = False
        if "create_attention_mask" in line:
            continue
        out.append(line)
    return out


def _tidy(lines: list[str]) -> list[str]:
    """No run of more than two blank lines, none at the ends."""
    out: list[str] = []
    for line in "\n".join(lines).splitlines():
        if not line.strip() and len(out) >= 2 and not out[-1].strip() and not out[-2].strip():
            continue
        out.append(line)
    while out and not out[-1].strip():
        out.pop()
    return out


def length(text: str) -> int:
    """A reproduction's length: its lines of code (blank lines, comments and docstrings not counted)."""
    count = 0
    in_doc = False
    for line in text.splitlines():
        stripped = line.strip()
        quotes = stripped.count('"""')
        if in_doc:
            in_doc = quotes % 2 == 0
            continue
        if stripped.startswith('"""'):
            in_doc = quotes % 2 == 1
            continue
        if stripped and not stripped.startswith("#"):
            count += 1
    return count
