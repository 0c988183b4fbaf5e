"""COMPAT.md, generated from the registry (``python -m kvpatch.maint.regenerate``), and fingerprints."""

from __future__ import annotations

import importlib
from typing import Any

from ..config import Config
from ..detect import Source, Upstream
from ..gate import Action, decide
from ..record import Kind, Patch
from ..registry import load
from .matrix import TESTED
from .retired import render_retired

__all__ = ["KNOWN_PINS", "TESTED", "render", "target_fingerprints"]

#: Git pins seen in the wild (downstream servers pin exact upstream commits).
KNOWN_PINS: dict[str, tuple[tuple[str, str], ...]] = {
    "mlx-vlm": (
        ("f96138ee", "0.5.0"),
        ("fea81522", "0.5.0"),
        ("6f60ee44", "0.5.0"),
    ),
}

_CELL = {
    Action.APPLY: "applies",
    Action.VERIFY: "verify",
    Action.NOT_NEEDED: "fixed",
    Action.OUT_OF_RANGE: "·",
}

_ALL = Config(enable_all=True)

_ACTION_TEXT = {
    Action.APPLY: "applies",
    Action.VERIFY: "reproduction decides",
    Action.NOT_NEEDED: "not needed",
    Action.OUT_OF_RANGE: "out of range",
}


def fixed_text(p: Patch) -> str:
    """The table's "fixed in" cell: the release (and commit), else how far it was checked."""
    if p.fixed_in:
        return p.fixed_in + (f" ({p.fixed_commit})" if p.fixed_commit else "")
    return f"not fixed as of {p.checked_through}" if p.checked_through else "not fixed"


def _pin_decision(patch: Patch, commit: str, version: str) -> str:
    upstream = Upstream(patch.distribution, version, Source(kind="vcs", url="git", commit=commit))
    decision = decide(patch, upstream, _ALL)
    return _ACTION_TEXT.get(decision.action, decision.action.value)


def render() -> str:
    reg = load()
    patches = sorted(reg.patches, key=lambda p: (p.distribution, p.id))
    out = [
        "# COMPAT: which kvpatch patch applies to which upstream release or commit",
        "",
        "Generated from the patch registry by `python -m kvpatch.maint.regenerate`; a test fails when it is",
        "stale. Ranges are PEP 440 over released versions. A git install is placed against the fixing",
        "commit with kvpatch's upstream commit index; a commit the index does not know, a pre-release of",
        "the fixing release, an editable install, or a release newer than the last one checked is left",
        "to the patch's reproduction (`reproduction decides`).",
        "",
        "## Patches",
        "",
        "| patch | catalogue | distribution | affected | fixed in | upstream | hot path | expiry |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in patches:
        expiry = p.expiry.condition + (f" (review by {p.expiry.review_by})" if p.expiry.review_by else "")
        out.append(
            f"| `{p.id}` | {p.catalogue} | {p.distribution} | `{p.affected}` | {fixed_text(p)} | {p.reference} | "
            f"{'yes' if p.hot_path else 'no'} | {expiry} |"
        )
    for dist, releases in TESTED.items():
        mine = [p for p in patches if p.distribution == dist]
        if not mine:
            continue
        out += [
            "",
            f"## {dist} releases (each one runs in the test matrix)",
            "",
            "`applies`: the patch is installed; `fixed`: upstream fixed it, not installed; `·`: the release",
            "predates the bug.",
            "",
            "| patch | " + " | ".join(releases) + " |",
            "|---|" + "---|" * len(releases),
        ]
        for p in mine:
            # opt-in patches are shown where they apply once enabled (KVPATCH_ENABLE), and marked so
            cells = [_CELL[decide(p, Upstream(dist, r), _ALL).action] for r in releases]
            out.append(f"| `{p.id}`{' (opt-in)' if p.opt_in else ''} | " + " | ".join(cells) + " |")
    out += ["", "## Targets", ""]
    for p in patches:
        targets = ", ".join(
            f"`{t.path}`" + (" (added)" if t.kind is Kind.ADD else "") + (" (if present)" if t.optional else "")
            for t in p.targets
        )
        out.append(f"- `{p.id}`: {targets}. {p.summary}")
    for dist, pins in KNOWN_PINS.items():
        mine = [p for p in patches if p.distribution == dist]
        if not mine:
            continue
        out += ["", f"## Known {dist} git pins", "", "| patch | " + " | ".join(f"`{c}`" for c, _ in pins) + " |"]
        out.append("|---|" + "---|" * len(pins))
        for p in mine:
            cells = [_pin_decision(p, commit, version) for commit, version in pins]
            out.append(f"| `{p.id}` | " + " | ".join(cells) + " |")
    out += ["", *render_retired().rstrip("\n").split("\n")]
    if reg.broken:
        out += ["", "## Broken units", ""] + [f"- {m}: {e}" for m, e in sorted(reg.broken.items())]
    return "\n".join(out) + "\n"


def target_fingerprints() -> dict[str, dict[str, Any]]:
    """Fingerprint every REPLACE target of every patch in the installed upstream (imports it)."""
    from .. import get_engine
    from ..fingerprints import fingerprint
    from ..installer import upstream_original
    from ..surgery import MISSING

    engine = get_engine()
    result: dict[str, dict[str, Any]] = {}
    for p in load().patches:
        entry: dict[str, Any] = {}
        for t in p.targets:
            if t.kind is not Kind.REPLACE:
                continue
            try:
                module = importlib.import_module(t.module)
            except Exception as exc:
                entry[t.path] = f"missing ({type(exc).__name__})"
                continue
            original = upstream_original(engine.installer.changes, t, module)  # looks through kvpatch's own changes
            entry[t.path] = "missing" if original is MISSING else fingerprint(original)
        result[p.id] = entry
    return result
