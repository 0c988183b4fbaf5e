"""The documented gaps: new findings kvpatch leaves unpatched, each with its reason, kept where maintainers read them
(docs/findings.md, the table after ``<!-- hunt:gaps -->``), not in code: the hunt knows invariants, never bugs.

Each row: the class or architecture (a regular expression over ``module.Name``), the invariant, a regular
expression over the finding's operation and detail (``"<operation>: <detail>"``), the releases (a PEP 440 range of
the distribution the class belongs to; empty: any), and the reason (the bug, its releases and upstream reference
where known, and why kvpatch leaves it). :mod:`.report` marks a ``new`` finding that matches a row "documented gap".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

MARK = "<!-- hunt:gaps -->"


@dataclass(frozen=True)
class Gap:
    target: str
    invariant: str
    detail: str
    releases: str
    reason: str


def read(page: Path) -> list[Gap]:
    """The rows of the gaps table that follows :data:`MARK` (on a line of its own) on ``page`` (none when the page has
    no such table)."""
    text = page.read_text(encoding="utf-8") if page.is_file() else ""
    _, found, rest = text.partition(f"\n{MARK}\n")  # the mark on a line of its own (prose may name it)
    out: list[Gap] = []
    for line in rest.splitlines() if found else []:
        if not line.startswith("|"):
            if out or line.strip():
                break
            continue
        cells = [c.strip().strip("`") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) != 5 or cells[0] in ("target", "") or set(cells[0]) <= set("-:"):
            continue
        out.append(Gap(*(c.replace("\\|", "|") for c in cells)))
    return out


def match(finding: dict[str, Any], gaps: list[Gap], releases: dict[str, str]) -> str | None:
    """The reason of the documented gap ``finding`` (found where ``releases`` are installed) is, or None."""
    target = finding.get("target", "")
    version = releases.get("mlx-vlm" if target.startswith("mlx_vlm") else "mlx-lm")
    for gap in gaps:
        if (
            gap.invariant == finding.get("invariant")
            and re.search(gap.target, target)
            and re.search(gap.detail, f"{finding.get('operation', '')}: {finding.get('detail', '')}")
            and (not gap.releases or (version is not None and Version(version) in SpecifierSet(gap.releases)))
        ):
            return gap.reason
    return None
