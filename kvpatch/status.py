"""The audit behind ``python -m kvpatch status``.

Without ``verify`` nothing here imports mlx: states come from the gate (a patch that will be applied
when its module is imported shows as ``pending``). With ``verify`` the target modules are imported and
every relevant reproduction runs with and without its patch.

JSON schema ``kvpatch.status/1`` (stable; new keys may be added, none removed or renamed)::

    {
      "schema": "kvpatch.status/1",
      "kvpatch": "<version>", "python": "3.11.7", "platform": "linux",
      "enabled": true,
      "upstream": {"mlx-lm": {"version": "0.32.2" | null,
                              "source": {"kind": "index|vcs|editable|directory|archive|unknown",
                                         "url": ..., "commit": ..., "error": ...}}, ...},
      "patches": [{"id", "summary", "distribution", "catalogue", "targets": [...], "affected",
                   "fixed_in", "fixed_commit", "checked_through", "reference", "hot_path",
                   "metal_only", "expiry": {"condition", "review_by", "overdue"},
                   "action", "state", "reason", "error", "drift": [...], "verified",
                   "verdict": null | "<this environment's stored verdict, for a patch the reproduction decides>",
                   "verify": null | {"outcome", "without_patch", "with_patch", "foreign": [...]}}],
      "broken": {"<module>": "<error>"},
      "problems": ["<configuration problem>", ...],
      "summary": {"<state>": <count>, ...},
      "check": {"exit": 0 | 1 | 2, "reasons": [...]}
    }

A finding (``without_patch`` / ``with_patch``) is ``{"present", "verdict", "detail", "skipped",
"inconclusive"}`` with ``verdict`` one of ``present``, ``absent``, ``inconclusive``, ``skipped``.

``check.exit``: 0 clean; 1 action needed (drifted patch, patch applied to drifted code, overdue
expiry, a conclusive reproduction that disagrees with the record, a configuration problem, and facts
about this environment that are not record errors: an inconclusive verdict or ``--verify`` finding, a
verification that could not run, a patch pending verification); 2 a patch failed or a patch unit could
not be loaded, or a patch did not fix its bug. Advice to edit a record is given only on a conclusive
finding on upstream's own code: an absent bug where another library's wrapper or replacement sits on a
target is reported as "fixed by something else in this process (<qualified name>)".
"""

from __future__ import annotations

import contextlib
import platform
import sys
from dataclasses import dataclass
from typing import Any

from . import __version__, verdicts
from .engine import Engine, PatchStatus, State, import_target_modules, run_reproduction
from .expiry import expiry_reasons
from .gate import Action
from .record import Finding, Patch

__all__ = ["Report", "build_report", "format_text"]

OUTCOME_FIXED = verdicts.FIXED
OUTCOME_ABSENT = verdicts.ABSENT
OUTCOME_NOT_FIXED = verdicts.NOT_FIXED
OUTCOME_UNPATCHED = "bug present, patch not applied"
OUTCOME_INCONCLUSIVE = "inconclusive"
OUTCOME_ELSEWHERE = "bug absent in this process, fixed by something else in this process"
OUTCOME_COULD_NOT_RUN = "could not run"


@dataclass
class Report:
    data: dict[str, Any]

    @property
    def exit_code(self) -> int:
        return int(self.data["check"]["exit"])


def _finding(f: Finding | None) -> dict[str, Any] | None:
    if f is None:
        return None
    return {
        "present": f.present,
        "verdict": f.verdict,
        "detail": f.detail,
        "skipped": f.skipped,
        "inconclusive": f.inconclusive,
    }


def _sharing(engine: Engine, patch: Patch) -> list[str]:
    """Ids of installed patches that change one of ``patch``'s targets (itself included)."""
    mine = {(t.module, t.qualname) for t in patch.targets}
    return [
        other.id
        for other in engine.patches
        if engine.status[other.id].installed and mine & {(t.module, t.qualname) for t in other.targets}
    ]


def verify_patch(engine: Engine, st: PatchStatus) -> dict[str, Any]:
    """Run one reproduction without and (if applied) with its patch.

    Without: every kvpatch patch on the same targets is taken out, so the finding is upstream's, unless
    something outside kvpatch sits on a target (another library's wrapper or replacement): then an absent
    bug is credited to that, never to upstream (:func:`kvpatch.verdicts.foreign_targets`).
    """
    patch = st.patch
    try:
        import_target_modules(patch)
        with engine.without(*_sharing(engine, patch)):
            foreign = verdicts.foreign_targets(patch)
            before = run_reproduction(patch)
        after: Finding | None = run_reproduction(patch) if st.state is State.APPLIED else None
    except Exception as exc:
        return {
            "outcome": f"{OUTCOME_COULD_NOT_RUN}: {type(exc).__name__}: {exc}",
            "without_patch": None,
            "with_patch": None,
            "foreign": [],
        }
    if before.verdict == "skipped":
        outcome = f"skipped: {before.skipped}"
    elif before.verdict == "inconclusive":
        outcome = f"{OUTCOME_INCONCLUSIVE} without the patch: {before.inconclusive}"
    elif before.verdict == "absent":
        outcome = f"{OUTCOME_ELSEWHERE} ({', '.join(foreign)})" if foreign else OUTCOME_ABSENT
    elif after is None:
        outcome = f"{OUTCOME_UNPATCHED} ({st.state.value})"
    elif after.verdict == "inconclusive":
        outcome = f"{OUTCOME_INCONCLUSIVE} with the patch: {after.inconclusive}"
    elif after.verdict == "present":
        outcome = OUTCOME_NOT_FIXED
    else:
        outcome = OUTCOME_FIXED
    return {
        "outcome": outcome,
        "without_patch": _finding(before),
        "with_patch": _finding(after),
        "foreign": foreign,
    }


def _verify_reasons(p: Patch, st: PatchStatus, outcome: str) -> tuple[list[str], list[str]]:
    """(exit-2 reasons, exit-1 reasons) for one ``--verify`` outcome. Only a conclusive finding on
    upstream's own code can say a record is wrong; everything else is a fact about this environment."""
    if outcome == OUTCOME_NOT_FIXED:
        return [f"{p.id}: {outcome}"], []
    if outcome.startswith(OUTCOME_COULD_NOT_RUN):
        return [], [f"{p.id}: verify {outcome} (this environment needs attention; not a record error)"]
    if outcome.startswith(OUTCOME_INCONCLUSIVE):
        return [], [f"{p.id}: verify {outcome} (an error that is not the bug: this environment needs attention)"]
    if outcome.startswith(OUTCOME_ELSEWHERE):
        return [], []  # not upstream's fix and not kvpatch's: nothing to change in the record
    if outcome.startswith(OUTCOME_UNPATCHED):
        if st.state in (State.NOT_NEEDED, State.OUT_OF_RANGE):
            return [], [f"{p.id}: {outcome}: the record says otherwise; update it"]
        if st.state is State.UNVERIFIED:
            return [], [f"{p.id}: {outcome}: no verdict in this process; run `python -m kvpatch verify`"]
        return [], []  # disabled, opt-in, failed, drifted, inconclusive: reported by its state
    if outcome == OUTCOME_ABSENT and st.state is State.APPLIED:
        return [], [f"{p.id}: applied, but the bug is absent upstream: update the record"]
    return [], []


def _relevant_for_verify(st: PatchStatus) -> bool:
    return st.state not in (State.OUT_OF_RANGE, State.NOT_INSTALLED)


def _cached_verdict(engine: Engine, st: PatchStatus) -> str | None:
    """The stored verdict for a patch the reproduction decides (read without importing upstream)."""
    if st.decision.action is not Action.VERIFY:
        return None
    found = verdicts.lookup(verdicts.key(st.patch, engine.upstream))
    return found.describe() if found else None


def build_report(engine: Engine, *, verify: bool = False) -> Report:
    with verdicts.measuring_as("status --verify", remeasure=True) if verify else contextlib.nullcontext():
        return _build_report(engine, verify=verify)


def _build_report(engine: Engine, *, verify: bool) -> Report:
    if verify:
        # Import every relevant target module so that the hooks install what applies (and, as this is a
        # verification, measure and store the verdict of every patch the reproduction decides).
        for st in engine.status.values():
            if _relevant_for_verify(st):
                try:
                    import_target_modules(st.patch)
                except Exception:  # reported per patch by verify_patch
                    pass
    patches: list[dict[str, Any]] = []
    summary: dict[str, int] = {}
    reasons_1: list[str] = []
    reasons_2: list[str] = []
    for p in engine.patches:
        st = engine.status[p.id]
        entry: dict[str, Any] = {
            "id": p.id,
            "summary": p.summary,
            "distribution": p.distribution,
            "catalogue": p.catalogue,
            "targets": [t.path for t in p.targets],
            "affected": p.affected,
            "fixed_in": p.fixed_in,
            "fixed_commit": p.fixed_commit,
            "checked_through": p.checked_through,
            "reference": p.reference,
            "hot_path": p.hot_path,
            "metal_only": p.metal_only,
            "expiry": {
                "condition": p.expiry.condition,
                "review_by": p.expiry.review_by.isoformat() if p.expiry.review_by else None,
                "overdue": p.expiry.overdue(),
            },
            "action": st.decision.action.value,
            "state": st.state.value,
            "reason": st.reason,
            "error": st.error,
            "drift": list(st.drift),
            "verified": st.verified,
            "verdict": _cached_verdict(engine, st),
            "verify": None,
        }
        if verify and _relevant_for_verify(st):
            entry["verify"] = verify_patch(engine, st)
            entry["state"], entry["reason"] = st.state.value, st.reason
            more_2, more_1 = _verify_reasons(p, st, entry["verify"]["outcome"])
            reasons_2.extend(more_2)
            reasons_1.extend(more_1)
        summary[st.state.value] = summary.get(st.state.value, 0) + 1
        if st.state is State.FAILED:
            reasons_2.append(f"{p.id}: {st.reason}")
        elif st.state is State.DRIFTED:
            reasons_1.append(f"{p.id}: drifted: {st.reason}")
        elif st.state is State.INCONCLUSIVE:
            reasons_1.append(f"{p.id}: inconclusive here, not applied (not a record error): {st.error}")
        elif st.state is State.UNVERIFIED or (
            st.state is State.PENDING and st.decision.action is Action.VERIFY and not entry["verdict"]
        ):
            reasons_1.append(
                f"{p.id}: pending verification (no verdict for this environment): run `python -m kvpatch verify`"
            )
        elif st.drift and st.state is State.APPLIED:
            reasons_1.append(f"{p.id}: applied to drifted code (reproduction confirmed); validate and record it")
        patches.append(entry)
    for module, error in engine.broken.items():
        reasons_2.append(f"{module}: could not be loaded: {error}")
    reasons_1.extend(expiry_reasons(engine.patches))
    reasons_1.extend(engine.config.problems)
    exit_code = 2 if reasons_2 else 1 if reasons_1 else 0
    data: dict[str, Any] = {
        "schema": "kvpatch.status/1",
        "kvpatch": __version__,
        "python": platform.python_version(),
        "platform": sys.platform,
        "enabled": engine.config.enabled,
        "upstream": {
            name: {
                "version": up.version,
                "source": {
                    "kind": up.source.kind,
                    "url": up.source.url,
                    "commit": up.source.commit,
                    "error": up.source.error,
                },
            }
            for name, up in engine.upstream.items()
        },
        "patches": patches,
        "broken": dict(engine.broken),
        "problems": list(engine.config.problems),
        "summary": summary,
        "check": {"exit": exit_code, "reasons": reasons_2 + reasons_1},
    }
    return Report(data)


def _state_text(entry: dict[str, Any]) -> str:
    if entry["state"] == State.PENDING.value:
        if entry["action"] == "apply":
            return "pending"
        verdict = entry.get("verdict")
        return f"pending ({verdict.split(' (')[0]})" if verdict else "pending verification"
    return str(entry["state"])


def format_text(report: Report) -> str:
    d = report.data
    lines = [
        f"kvpatch {d['kvpatch']} on Python {d['python']} ({d['platform']})"
        + ("" if d["enabled"] else ": OFF (KVPATCH=off)")
    ]
    for name, up in d["upstream"].items():
        src = up["source"]
        where = "not installed" if up["version"] is None else up["version"]
        if up["version"] is not None and src["kind"] != "index":
            where += f" ({src['kind']} {src['url'] or ''}{'@' + src['commit'][:12] if src['commit'] else ''})".replace(
                " )", ")"
            )
            if src["error"]:
                where += f" [{src['error']}]"
        lines.append(f"  {name:<8} {where}")
    lines.append("")
    header = ("patch", "state", "affected", "fixed in", "reference")
    rows = [(e["id"], _state_text(e), e["affected"], _fixed_text(e), e["reference"]) for e in d["patches"]]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines.append(fmt.format(*header).rstrip())
    for e, row in zip(d["patches"], rows, strict=True):
        lines.append(fmt.format(*row).rstrip())
        lines.append(f"    target: {', '.join(e['targets'])}")
        lines.append(f"    why:    {e['reason']}")
        if e["verify"]:
            lines.append(f"    verify: {e['verify']['outcome']}")
    for module, error in d["broken"].items():
        lines.append(f"BROKEN {module}: {error}")
    for problem in d["problems"]:
        lines.append(f"config: {problem}")
    lines.append("")
    summary = ", ".join(f"{n} {s}" for s, n in sorted(d["summary"].items()))
    lines.append(f"summary: {len(d['patches'])} patches: {summary}")
    check = d["check"]
    if check["reasons"]:
        lines.append(f"check: exit {check['exit']}")
        lines.extend(f"  - {r}" for r in check["reasons"])
    else:
        lines.append("check: clean (exit 0)")
    return "\n".join(lines)


def _fixed_text(entry: dict[str, Any]) -> str:
    if entry["fixed_in"]:
        return f"{entry['fixed_in']}" + (f" ({entry['fixed_commit'][:8]})" if entry["fixed_commit"] else "")
    return f"not fixed as of {entry['checked_through']}" if entry["checked_through"] else "not fixed"
