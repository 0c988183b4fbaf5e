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
                   "verify": null | {"outcome", "without_patch", "with_patch"}}],
      "broken": {"<module>": "<error>"},
      "problems": ["<configuration problem>", ...],
      "summary": {"<state>": <count>, ...},
      "check": {"exit": 0 | 1 | 2, "reasons": [...]}
    }

``check.exit``: 0 clean; 1 action needed (drifted patch, patch applied to drifted code, overdue
expiry, a reproduction that disagrees with the record, a configuration problem); 2 a patch failed or a
patch unit could not be loaded, or a patch did not fix its bug.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass
from typing import Any

from . import __version__
from .engine import Engine, PatchStatus, State, import_target_modules, run_reproduction
from .record import Finding

__all__ = ["Report", "build_report", "format_text"]

OUTCOME_FIXED = "bug present, fixed by patch"
OUTCOME_ABSENT = "bug absent upstream"
OUTCOME_NOT_FIXED = "bug present, NOT fixed by patch"
OUTCOME_UNPATCHED = "bug present, patch not applied"


@dataclass
class Report:
    data: dict[str, Any]

    @property
    def exit_code(self) -> int:
        return int(self.data["check"]["exit"])


def _finding(f: Finding | None) -> dict[str, Any] | None:
    if f is None:
        return None
    return {"present": f.present, "detail": f.detail, "skipped": f.skipped}


def verify_patch(engine: Engine, st: PatchStatus) -> dict[str, Any]:
    """Run one reproduction without and (if applied) with its patch."""
    patch = st.patch
    try:
        import_target_modules(patch)
        if st.state is State.APPLIED:
            with engine.without(patch.id):
                before = run_reproduction(patch)
            after: Finding | None = run_reproduction(patch)
        else:
            before, after = run_reproduction(patch), None
    except Exception as exc:
        return {"outcome": f"could not run: {type(exc).__name__}: {exc}", "without_patch": None, "with_patch": None}
    if before.skipped:
        outcome = f"skipped: {before.skipped}"
    elif not before.present:
        outcome = OUTCOME_ABSENT
    elif after is None:
        outcome = f"{OUTCOME_UNPATCHED} ({st.state.value})"
    elif after.present:
        outcome = OUTCOME_NOT_FIXED
    else:
        outcome = OUTCOME_FIXED
    return {"outcome": outcome, "without_patch": _finding(before), "with_patch": _finding(after)}


def _relevant_for_verify(st: PatchStatus) -> bool:
    return st.state not in (State.OUT_OF_RANGE, State.NOT_INSTALLED)


#: States that are facts about this environment needing attention: ``--check`` exits 2 on these.
_FAILING = {State.FAILED.value, State.TARGET_MISSING.value}
#: ... and 1 on these.
_ATTENTION = {State.DRIFTED.value, State.OVERRIDDEN.value}


def build_report(engine: Engine, *, verify: bool = False, settle: bool = True, fresh: bool = False) -> Report:
    """The audit. ``settle`` (default): outcomes, not predictions (see :mod:`kvpatch.settle`)."""
    settled = None
    if settle and not verify:
        from .settle import settle as settle_outcomes

        settled = settle_outcomes(engine, fresh=fresh)
    else:
        engine.refresh()
    if verify:
        # Import every relevant target module so that the hooks install what applies.
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
            "notes": list(st.notes),
            "wrapped": list(st.wrapped),
            "opt_in": p.opt_in,
            "verify": None,
        }
        if settled is not None and settled.how == "cache" and p.id in settled.outcomes:
            entry.update({k: settled.outcomes[p.id].get(k, entry[k]) for k in ("state", "reason", "error", "notes")})
        if verify and _relevant_for_verify(st):
            entry["verify"] = verify_patch(engine, st)
            entry["state"], entry["reason"] = st.state.value, st.reason
            outcome = entry["verify"]["outcome"]
            if outcome == OUTCOME_NOT_FIXED:
                reasons_2.append(f"{p.id}: {outcome}")
            elif outcome.startswith(OUTCOME_UNPATCHED) and st.state not in (State.DISABLED, State.OPT_IN):
                reasons_1.append(f"{p.id}: {outcome}: the record says otherwise; update it")
            elif outcome == OUTCOME_ABSENT and st.state is State.APPLIED:
                reasons_1.append(f"{p.id}: applied, but the bug is absent upstream: update the record")
        state = entry["state"]
        summary[state] = summary.get(state, 0) + 1
        if state in _FAILING:
            reasons_2.append(f"{p.id}: {entry['reason']}")
        elif state in _ATTENTION:
            reasons_1.append(f"{p.id}: {state}: {entry['reason']}")
        elif st.drift and st.state is State.APPLIED:
            reasons_1.append(f"{p.id}: applied to drifted code (reproduction confirmed); validate and record it")
        patches.append(entry)
    for module, error in engine.broken.items():
        reasons_2.append(f"{module}: could not be loaded: {error}")
    if engine.config.enforce:
        # Review-by dates are the project's own deadlines: they fail kvpatch's CI (KVPATCH_ENFORCE=1), never
        # an operator's health check on a calendar day with nothing changed in the environment.
        from .expiry import expiry_reasons

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
        "settled": None if settled is None else {"how": settled.how, "at": settled.at},
        "patches": patches,
        "broken": dict(engine.broken),
        "problems": list(engine.config.problems),
        "summary": summary,
        "check": {"exit": exit_code, "reasons": reasons_2 + reasons_1},
    }
    return Report(data)


def _state_text(entry: dict[str, Any]) -> str:
    if entry["state"] == State.PENDING.value:
        return "pending" if entry["action"] == "apply" else "pending (verify)"
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
