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
                   "verdict_file": null | "<the file that verdict was read from>",
                   "verify": null | {"outcome", "without_patch", "with_patch", "foreign": [...]}}],
      "auto_activation": null | "<why kvpatch's start-up hook does not run in this interpreter>",
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
from dataclasses import dataclass, field
from typing import Any

from . import __version__, measurer, verdicts
from .detect import Upstream
from .engine import Engine, Measurement, PatchStatus, State, import_target_modules
from .gate import Action
from .record import Bug, Finding, Patch
from .verdicts import Outcome

__all__ = ["Report", "build_report", "format_text"]


@dataclass
class Report:
    data: dict[str, Any]
    #: patch id -> the ``--verify`` outcome (``data`` says it in words).
    outcomes: dict[str, Outcome] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return int(self.data["check"]["exit"])


def _finding(f: Finding | None) -> dict[str, Any] | None:
    if f is None:
        return None
    return {
        "present": f.present,
        "verdict": f.bug.value,  # the key predates Finding.bug; the schema keeps it
        "detail": f.detail,
        "skipped": f.skipped,
        "inconclusive": f.inconclusive,
    }


def verify_patch(engine: Engine, st: PatchStatus) -> tuple[Outcome, dict[str, Any]]:
    """The patch's reproduction without and (where applied) with it (:meth:`kvpatch.engine.Engine.measure`),
    reusing the measurement the engine made in this process when it settled a verdict (each side runs once)."""
    try:
        measured = st.measurement or engine.measure(engine.record_of(st), install=False)
    except Exception as exc:
        text = f"{Outcome.COULD_NOT_RUN.value}: {type(exc).__name__}: {exc}"
        return Outcome.COULD_NOT_RUN, {"outcome": text, "without_patch": None, "with_patch": None, "foreign": []}
    applied = st.state is State.APPLIED
    outcome, _ = measured.outcome(applied)
    return outcome, {
        "outcome": _outcome_text(outcome, measured, st),
        "without_patch": _finding(measured.before),
        "with_patch": _finding(measured.after if applied else None),
        "foreign": list(measured.foreign),
    }


def _outcome_text(outcome: Outcome, m: Measurement, st: PatchStatus) -> str:
    """How ``status`` says an outcome (the ``verify.outcome`` of the JSON report)."""
    if outcome is Outcome.SKIPPED:
        return f"skipped: {m.before.skipped}"
    if outcome is Outcome.INCONCLUSIVE:
        if m.before.bug is Bug.INCONCLUSIVE or m.after is None:
            return f"{outcome.value} without the patch: {m.before.inconclusive}"
        return f"{outcome.value} with the patch: {m.after.inconclusive or m.after.skipped}"
    if outcome is Outcome.ELSEWHERE:
        return f"{outcome.value} ({', '.join(m.foreign)})"
    if outcome is Outcome.UNPATCHED:
        return f"{outcome.value} ({st.state.value})"
    return outcome.value


def _verify_reasons(p: Patch, st: PatchStatus, kind: Outcome, outcome: str) -> tuple[list[str], list[str]]:
    """(exit-2 reasons, exit-1 reasons) for one ``--verify`` outcome (``outcome``: as the report says it). Only
    a conclusive finding on upstream's own code can say a record is wrong; everything else is a fact about
    this environment."""
    if kind is Outcome.NOT_FIXED:
        return [f"{p.id}: {outcome}"], []
    if kind is Outcome.COULD_NOT_RUN:
        return [], [f"{p.id}: verify {outcome} (this environment needs attention; not a record error)"]
    if kind is Outcome.INCONCLUSIVE:
        return [], [f"{p.id}: verify {outcome} (an error that is not the bug: this environment needs attention)"]
    if kind is Outcome.UNPATCHED:
        if st.state in (State.NOT_NEEDED, State.OUT_OF_RANGE):
            return [], [f"{p.id}: {outcome}: the record says otherwise; update it"]
        if st.state is State.UNVERIFIED:
            return [], [f"{p.id}: {outcome}: no verdict in this process; run `python -m kvpatch verify`"]
        return [], []  # disabled, opt-in, failed, drifted, inconclusive: reported by its state
    if kind is Outcome.ABSENT and st.state is State.APPLIED:
        return [], [f"{p.id}: applied, but the bug is absent upstream: update the record"]
    return [], []  # fixed, skipped, or fixed by something else (not upstream's fix and not kvpatch's)


def _relevant_for_verify(st: PatchStatus) -> bool:
    return st.state not in (State.OUT_OF_RANGE, State.NOT_INSTALLED)


#: States that are facts about this environment needing attention: ``--check`` exits 2 on these.
_FAILING = {State.FAILED.value, State.TARGET_MISSING.value}
#: ... and 1 on these.
_ATTENTION = {State.DRIFTED.value, State.OVERRIDDEN.value}


def _cached_verdict(engine: Engine, st: PatchStatus) -> verdicts.Verdict | None:
    """The stored verdict for a patch the reproduction decides (read without importing upstream)."""
    if st.decision.action is not Action.VERIFY:
        return None
    return verdicts.lookup(verdicts.key(engine.record_of(st), engine.upstream))


def auto_activation() -> str | None:
    """Why kvpatch's ``.pth`` start-up hook does not run in this interpreter (``None``: it does), e.g. a
    ``pip install --target`` directory on ``PYTHONPATH``, which ``site`` does not process."""
    # The bootstrap notes the start-up sys.path when kvpatch.pth / kvpatch.start hand over to it; until the first
    # mlx import the .pth's stand-in finder is on sys.meta_path instead. (kvpatch itself loads _kvpatch_boot too,
    # for its reading of KVPATCH, so the module being loaded says nothing.)
    boot = sys.modules.get("_kvpatch_boot")
    if getattr(boot, "_startup_path", None) is not None or any(
        getattr(f, "__name__", type(f).__name__) == "KvpatchBootstrapFinder" for f in sys.meta_path
    ):
        return None
    if sys.flags.no_site:
        return "off: this interpreter runs without site (-S); use `import kvpatch` or `kvpatch run`"
    return (
        "off: kvpatch.pth is not in a site directory of this interpreter (a --target install on PYTHONPATH?); "
        "use `import kvpatch` or `kvpatch run`"
    )


def build_report(engine: Engine, *, verify: bool = False, settle: bool = True, fresh: bool = False) -> Report:
    """The audit. ``settle`` (default): outcomes, not predictions (see :mod:`kvpatch.settle`)."""
    with measurer.measuring_as("status --verify", remeasure=True) if verify else contextlib.nullcontext():
        return _build_report(engine, verify=verify, settle=settle, fresh=fresh)


def _build_report(engine: Engine, *, verify: bool, settle: bool, fresh: bool) -> Report:
    records = engine.materialise()  # the report shows every record
    settled = None
    if settle and not verify:
        from .settle import settle as settle_outcomes

        settled = settle_outcomes(engine, fresh=fresh)
    else:
        engine.refresh()
    if verify:
        # Import every relevant target module so that the hooks install what applies (and, as this is a
        # verification, measure and store the verdict of every patch the reproduction decides).
        for st in engine.status.values():
            if _relevant_for_verify(st):
                try:
                    import_target_modules(engine.record_of(st))
                except Exception:  # reported per patch by verify_patch
                    pass
    patches: list[dict[str, Any]] = []
    summary: dict[str, int] = {}
    reasons_1: list[str] = []
    reasons_2: list[str] = []
    outcomes: dict[str, Outcome] = {}
    for p in records:
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
            "verdict": None,
            "verdict_file": None,
            "verify": None,
        }
        stored = _cached_verdict(engine, st)
        if stored is not None:
            entry["verdict"], entry["verdict_file"] = stored.describe(), stored.source or None
        if settled is not None and settled.how == "cache" and p.id in settled.outcomes:
            entry.update({k: settled.outcomes[p.id].get(k, entry[k]) for k in ("state", "reason", "error", "notes")})
        if verify and _relevant_for_verify(st):
            kind, entry["verify"] = verify_patch(engine, st)
            outcomes[p.id] = kind
            entry["state"], entry["reason"] = st.state.value, st.reason
            more_2, more_1 = _verify_reasons(p, st, kind, entry["verify"]["outcome"])
            reasons_2.extend(more_2)
            reasons_1.extend(more_1)
        state = entry["state"]
        summary[state] = summary.get(state, 0) + 1
        if state in _FAILING:
            reasons_2.append(f"{p.id}: {entry['reason']}")
        elif state in _ATTENTION:
            reasons_1.append(f"{p.id}: {state}: {entry['reason']}")
        elif state == State.INCONCLUSIVE.value:
            reasons_1.append(f"{p.id}: inconclusive here, not applied (not a record error): {entry['error']}")
        elif state == State.UNVERIFIED.value or (
            state == State.PENDING.value and st.decision.action is Action.VERIFY and not entry["verdict"]
        ):
            reasons_1.append(f"{p.id}: pending verification (no verdict for this environment): run `kvpatch verify`")
        elif st.drift and st.state is State.APPLIED:
            reasons_1.append(f"{p.id}: applied to drifted code (reproduction confirmed); validate and record it")
        patches.append(entry)
    for module, error in engine.broken.items():
        reasons_2.append(f"{module}: could not be loaded: {error}")
    copies = _copies(reasons_1, reasons_2)
    if engine.config.enforce:
        # Review-by dates are the project's own deadlines: they fail kvpatch's CI (KVPATCH_ENFORCE=1), never an
        # operator's health check on a calendar day with nothing changed in the environment. (A patch fixed in
        # every supported release fails kvpatch's own tests: tests/engine/test_expiry.py.)
        for p in records:
            if p.expiry.overdue():
                assert p.expiry.review_by is not None
                reasons_1.append(
                    f"{p.id}: review-by date {p.expiry.review_by.isoformat()} has passed ({p.expiry.condition}): run "
                    "`python -m kvpatch upstream-check`, then retire the patch or set a new Expiry(review_by=...)"
                )
    reasons_1.extend(engine.config.problems)
    exit_code = 2 if reasons_2 else 1 if reasons_1 else 0
    data: dict[str, Any] = {
        "schema": "kvpatch.status/1",
        "kvpatch": __version__,
        "python": platform.python_version(),
        "platform": sys.platform,
        "enabled": engine.config.enabled,
        "upstream": {name: upstream_entry(up) for name, up in engine.upstream.items()},
        "settled": None if settled is None else {"how": settled.how, "at": settled.at},
        "auto_activation": auto_activation(),
        "patches": patches,
        **({"copies": copies} if copies else {}),
        "broken": dict(engine.broken),
        "problems": list(engine.config.problems),
        "summary": summary,
        "check": {"exit": exit_code, "reasons": reasons_2 + reasons_1},
    }
    return Report(data, outcomes)


def _copies(reasons_1: list[str], reasons_2: list[str]) -> list[dict[str, Any]]:
    """One entry per (patch, vendored copy a server registered): ``{"id", "copy", "state", "reason", "error"}``
    (the report's ``copies`` key, present when a copy is registered); their check reasons are added."""
    vendored = sys.modules.get("kvpatch.vendored")
    out = []
    for st in vendored.copy_records() if vendored is not None else ():
        pid, state = st.patch.id, st.state.value
        out.append({"id": pid, "copy": st.copy, "state": state, "reason": st.reason, "error": st.error})
        if state in _FAILING:
            reasons_2.append(f"{pid} in {st.copy}: {st.reason}")
        elif state in _ATTENTION or st.state is State.UNVERIFIED:
            reasons_1.append(f"{pid} in {st.copy}: {state}: {st.reason}")
    return out


# -- presentation -------------------------------------------------------------------------------------


def upstream_entry(up: Upstream) -> dict[str, Any]:
    """One distribution in the JSON report (``upstream.<name>``)."""
    return {
        "version": up.version,
        "installed": up.installed,
        "version_unknown": up.version_unknown,
        "source": {
            "kind": up.source.kind,
            "url": up.source.url,
            "commit": up.source.commit,
            "error": up.source.error,
        },
    }


#: States shown in the compact view only as a count in the summary line.
QUIET_STATES = frozenset({State.NOT_NEEDED.value, State.OUT_OF_RANGE.value, State.NOT_INSTALLED.value})

#: How the compact view groups what it shows, attention first: (state as ``_state_text`` says it, title).
#: A state missing here is shown too, under its own name, after the attention groups.
_GROUPS: tuple[tuple[str, str], ...] = (
    ("failed", "FAILED: not applied, the bug is live"),
    ("target missing", "TARGET MISSING: upstream moved or removed what the patch replaces"),
    ("drifted", "DRIFTED: the target's code is not what the patch was validated on"),
    ("inconclusive", "INCONCLUSIVE: the reproduction could not tell"),
    ("pending (verify)", "pending verification: the reproduction decides"),
    ("pending verification", "pending verification: the reproduction decides"),
    ("overridden", "overridden"),
    ("opt-in", "opt-in available: off unless KVPATCH_ENABLE names it"),
    ("disabled", "disabled"),
    ("applied", "applied"),
    ("pending", "will apply when its module is imported"),
)
_RANK = {state: i for i, (state, _) in enumerate(_GROUPS)}
_ATTENTION_END = _RANK["pending (verify)"]
#: Verify outcomes that say nothing new about the patch's state.
_EXPECTED_OUTCOMES = frozenset({Outcome.FIXED, Outcome.ABSENT, Outcome.SKIPPED})


def _state_text(entry: dict[str, Any]) -> str:
    if entry["state"] == State.PENDING.value:
        if entry["action"] == "apply":
            return "pending"
        verdict = entry.get("verdict")
        return f"pending ({verdict.split(' (')[0]})" if verdict else "pending verification"
    return str(entry["state"])


def _notable_verify(entry: dict[str, Any], outcomes: dict[str, Outcome]) -> str | None:
    """The verify outcome when it is worth a line of its own in the compact view."""
    verify = entry.get("verify")
    if not verify or outcomes.get(entry["id"]) in _EXPECTED_OUTCOMES:
        return None
    return str(verify.get("outcome") or "")


def format_text(report: Report, *, verbose: bool = False, width: int | None = None, check: bool = False) -> str:
    """The text of ``kvpatch status``: compact by default, every patch with ``verbose`` (``-v``).

    ``width`` cuts one-line summaries to fit a terminal (``None``: never cut, for pipes and logs); with
    ``verbose`` it is the width every line wraps to (default 80). ``check``: the command was asked for an
    exit status (``--check``, ``--verify``), so the check line says which.
    """
    d = report.data
    lines = _header(d)
    if verbose or width is not None:
        lines = [part for line in lines for part in _fitted(line, width or 80)]
    lines.append("")
    lines.extend(_full_table(d, width or 80) if verbose else _compact(d, report.outcomes, width))
    reasons = "\n".join(d["check"]["reasons"])  # what the check section lists is not repeated above it
    lines.extend(f"BROKEN patch module {m}: {e}" for m, e in d["broken"].items() if f"{m}: " not in reasons)
    lines.extend(f"config: {problem}" for problem in d["problems"] if problem not in reasons)
    if lines[-1]:
        lines.append("")
    lines.extend(_check(d, asked=check))
    if not verbose:
        lines.append("`kvpatch status -v` lists every patch with its targets and reason.")
    return "\n".join(lines)


def _header(d: dict[str, Any]) -> list[str]:
    off = "" if d["enabled"] else ": OFF (KVPATCH=off), nothing is patched"
    lines = [f"kvpatch {d['kvpatch']} on Python {d['python']} ({d['platform']}){off}"]
    if d.get("auto_activation"):
        lines.append(f"auto-activation: {d['auto_activation']}")
    shown, notes = [], []
    for name, up in d["upstream"].items():
        src = up["source"]
        if up["version"] is not None:
            shown.append(f"{name} {up['version']}")
        elif up.get("version_unknown") or up.get("installed"):
            shown.append(f"{name} (version unknown)")
            notes.append(
                f"  {name}: installed, version unknown ({up.get('version_unknown')}): the reproduction decides"
            )
            continue
        else:
            shown.append(f"{name} not installed")
            continue
        if src["kind"] not in ("index", "none"):
            where = f"{src['kind']} install" + (f" {src['url']}" if src["url"] else "")
            if src["commit"]:
                where += f"@{src['commit'][:12]}"
            if src["error"]:
                where += f" [{src['error']}]"
            notes.append(f"  {name}: {where}")
    lines.append("upstream: " + ", ".join(shown))
    lines.extend(notes)
    lines.append(f"{len(d['patches'])} patches: {_state_counts(d)}" if d["patches"] else "no patches loaded")
    verified = _verify_counts(d)
    if verified:
        lines.append(f"verified: {verified}")
    return lines


def _state_counts(d: dict[str, Any]) -> str:
    """``"13 not needed, 11 pending, 25 for mlx-vlm (not installed)"``: patches by state, the ones whose
    package is absent by package (so "not installed" cannot read as "failed to install")."""
    counts = {s: n for s, n in d["summary"].items() if s != State.NOT_INSTALLED.value}
    parts = [f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    absent: dict[str, int] = {}
    for e in d["patches"]:
        if e["state"] == State.NOT_INSTALLED.value:
            absent[e["distribution"]] = absent.get(e["distribution"], 0) + 1
    parts.extend(f"{n} for {dist} (not installed)" for dist, n in absent.items())
    return ", ".join(parts)


#: How many patch ids a count names ("1 skipped (offset-detach)") before it says "...".
_NAMED_IDS = 4


def _verify_counts(d: dict[str, Any]) -> str:
    """Outcomes of ``--verify`` by count; a skipped reproduction names its patches (a skip hides a check)."""
    ids: dict[str, list[str]] = {}
    for e in d["patches"]:
        if e.get("verify"):
            outcome = str(e["verify"].get("outcome") or "")
            key = "skipped" if outcome.startswith("skipped") else outcome
            ids.setdefault(key, []).append(e["id"])
    parts = []
    for key, named in sorted(ids.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        text = f"{len(named)} {key}"
        if key == "skipped":
            shown = ", ".join(named[:_NAMED_IDS]) + (", ..." if len(named) > _NAMED_IDS else "")
            text += f" ({shown}: `kvpatch status -v` says why)"
        parts.append(text)
    return "; ".join(parts)


def _not_installed_lines(d: dict[str, Any], entries: list[dict[str, Any]]) -> list[str]:
    """One line per distribution that is not installed (not one per patch)."""
    by_dist: dict[str, int] = {}
    for e in entries:
        by_dist[e["distribution"]] = by_dist.get(e["distribution"], 0) + 1
    return [f"{dist} not installed: its {n} patches do not apply" for dist, n in by_dist.items()]


def _compact(d: dict[str, Any], outcomes: dict[str, Outcome], width: int | None) -> list[str]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for e in d["patches"]:
        state = _state_text(e)
        if state in QUIET_STATES and not _notable_verify(e, outcomes):
            continue
        groups.setdefault(state, []).append(e)
    if not groups:
        installed = [name for name, up in d["upstream"].items() if up.get("installed", up["version"] is not None)]
        if not any(name in installed for name in ("mlx-lm", "mlx-vlm")):
            return ["nothing to patch here: neither mlx-lm nor mlx-vlm is installed", ""]
        return ["nothing to patch here: every patch is fixed upstream or predates this release", ""]
    pad = max(len(e["id"]) for es in groups.values() for e in es)
    order = sorted(groups, key=lambda s: _RANK.get(s, _ATTENTION_END))
    lines: list[str] = []
    for state in order:
        entries = groups[state]
        title = dict(_GROUPS).get(state, state)
        lines.append(f"{title} ({len(entries)}):")
        if state == "disabled":
            lines.extend(_wrapped(", ".join(e["id"] for e in entries), "  ", width))
            lines.append("")
            continue
        explained = state in QUIET_STATES or _RANK.get(state, _ATTENTION_END) <= _ATTENTION_END
        shared = explained and len(entries) > 1 and len({e["reason"] for e in entries}) == 1
        if shared:  # one reason for the whole group (a distribution whose version is unknown): say it once
            lines.extend(_wrapped(f"all {len(entries)}: {entries[0]['reason']}", "  ", width))
        for e in entries:
            lines.append(_cut(f"  {e['id']:<{pad}}  {e['summary']}", width))
            if explained and not shared:
                lines.extend(_wrapped(f"{state}: {e['reason']}", " " * (pad + 4), width))
                if e.get("error") and e["error"] not in e["reason"]:
                    lines.extend(_wrapped(f"error: {e['error']}", " " * (pad + 4), width))
            elif state == "opt-in":
                lines.append(f"{' ' * (pad + 4)}turn it on: KVPATCH_ENABLE={e['id']}")
            notable = _notable_verify(e, outcomes)
            if notable:
                lines.extend(_wrapped(f"verify: {notable}", " " * (pad + 4), width))
        lines.append("")
    return lines


def _full_table(d: dict[str, Any], width: int) -> list[str]:
    """Every present patch: its id and state, then its details, each wrapped to ``width``."""
    absent = [e for e in d["patches"] if e["state"] == State.NOT_INSTALLED.value]
    present = [e for e in d["patches"] if e["state"] != State.NOT_INSTALLED.value]
    lines: list[str] = []
    if present:
        pad = max(len(e["id"]) for e in present)
        for e in present:
            lines.append(f"{e['id']:<{pad}}  {_state_text(e)}")
            details = [
                ("affected", e["affected"]),
                ("fixed in", _fixed_text(e)),
                ("target", ", ".join(e["targets"])),
                ("why", e["reason"]),
            ]
            if e.get("verdict_file"):
                details.append(("verdict", e["verdict_file"]))
            if e.get("error") and e["error"] not in e["reason"]:
                details.append(("error", e["error"]))
            if e["verify"]:
                details.append(("verify", str(e["verify"]["outcome"])))
            details.append(("reference", e["reference"]))
            for label, text in details:
                lines.extend(_wrapped(text, f"    {label + ':':<11}", width, hang=""))
    if absent:
        if lines:
            lines.append("")
        lines.extend(_not_installed_lines(d, absent))
    lines.append("")
    return lines


def _check(d: dict[str, Any], *, asked: bool) -> list[str]:
    """The check's verdict; its exit status is named only to a command that asked for one (``--check``)."""
    check = d["check"]
    code = check["exit"]
    if not check["reasons"]:
        return [f"check: clean (exit {code})" if asked else "check: clean, nothing needs attention"]
    what = {1: "attention needed", 2: "a patch failed or did not fix its bug"}.get(code, f"exit {code}")
    exits = f"exit {code}" if asked else f"`kvpatch status --check` exits {code}"
    return [f"check: {what} ({exits}):", *(f"  - {r}" for r in check["reasons"])]


def _cut(text: str, width: int | None) -> str:
    if width is None or len(text) <= width:
        return text
    return text[: max(width - 3, 10)] + "..."


def _fitted(line: str, width: int) -> list[str]:
    """``line`` wrapped to ``width`` under its own indentation (a line that fits is kept as it is)."""
    if len(line) <= width:
        return [line]
    body = line.lstrip(" ")
    return _wrapped(body, line[: len(line) - len(body)], width)


def _wrapped(text: str, indent: str, width: int | None, hang: str = "  ") -> list[str]:
    """``text`` wrapped after ``indent`` (continuation lines under it, plus ``hang``); a word longer than the
    line (a URL, a dotted target name) is kept whole."""
    import textwrap

    return textwrap.wrap(
        text,
        width=max(width or 120, len(indent) + 40),
        initial_indent=indent,
        subsequent_indent=" " * len(indent) + hang,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [indent.rstrip()]


def _fixed_text(entry: dict[str, Any]) -> str:
    if entry["fixed_in"]:
        return f"{entry['fixed_in']}" + (f" ({entry['fixed_commit'][:8]})" if entry["fixed_commit"] else "")
    return f"not fixed as of {entry['checked_through']}" if entry["checked_through"] else "not fixed"
