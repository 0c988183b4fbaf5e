"""The audit behind ``kvpatch status``: every patch's state and why, and the check's exit status.

Without ``verify`` no reproduction runs: states come from the gate and, once per environment, from what
importing upstream does (:mod:`kvpatch.settle`; without ``settle``, the gate alone). With ``verify`` each
relevant patch is measured by :meth:`kvpatch.engine.Engine.measure`, and this module only says what it found.
The JSON form follows ``kvpatch/data/status.schema.json`` (schema ``kvpatch.status/1``: keys are added, never
removed or renamed).

``check.exit``: 2 a patch failed, a patch unit could not be loaded, or a patch did not fix its bug; 1 a fact
about this environment needs attention (drift, an override, inconclusive, pending verification, a verification
that could not run, a configuration problem) or a conclusive finding on upstream's own code disagrees with the
record; else 0. Only such a conclusive finding advises editing a record: an absent bug where another library's
code sits on a target is reported as fixed by something else in this process.
"""

from __future__ import annotations

import contextlib
import platform
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from . import __version__, _copy_records, measurer, verdicts
from .detect import Upstream
from .engine import Engine, PatchStatus, State, import_target_modules
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
    found = {"present": f.present, "verdict": f.bug.value}  # "verdict": the schema's name for Finding.bug
    return found | {k: getattr(f, k) for k in ("detail", "skipped", "inconclusive")}


def _verify(engine: Engine, st: PatchStatus) -> tuple[Outcome, dict[str, Any]]:
    """The patch's measurement (the engine's own when it settled a verdict in this process, so each side runs
    once) and how the report says it."""
    try:
        m = st.measurement or engine.measure(engine.record_of(st), install=False)
    except Exception as exc:
        text = f"{Outcome.COULD_NOT_RUN.value}: {type(exc).__name__}: {exc}"
        return Outcome.COULD_NOT_RUN, {"outcome": text, "without_patch": None, "with_patch": None, "foreign": []}
    applied = st.state is State.APPLIED
    outcome, detail = m.outcome(applied)
    text = outcome.value
    if outcome is Outcome.SKIPPED:
        text = f"skipped: {detail}"
    elif outcome is Outcome.INCONCLUSIVE:  # the patch was tried unless the run without it was inconclusive
        tried = m.after if m.before.bug is not Bug.INCONCLUSIVE else None
        text += f" with the patch: {tried.inconclusive or tried.skipped}" if tried else f" {detail}"
    elif outcome is Outcome.ELSEWHERE:
        text += f" ({detail})"
    elif outcome is Outcome.UNPATCHED:
        text += f" ({st.state.value})"
    after = _finding(m.after if applied else None)
    return outcome, {
        "outcome": text,
        "without_patch": _finding(m.before),
        "with_patch": after,
        "foreign": list(m.foreign),
    }


def _verify_reasons(
    pid: str, st: PatchStatus, outcome: Outcome, text: str, failed: list[str], attention: list[str]
) -> None:
    """The check reasons of one ``--verify`` outcome: only a conclusive finding on upstream's own code says a
    record is wrong; everything else is a fact about this environment."""
    if outcome is Outcome.NOT_FIXED:
        failed.append(f"{pid}: {text}")
    elif outcome is Outcome.COULD_NOT_RUN:
        attention.append(f"{pid}: verify {text} (this environment needs attention; not a record error)")
    elif outcome is Outcome.INCONCLUSIVE:
        attention.append(f"{pid}: verify {text} (an error that is not the bug: this environment needs attention)")
    elif outcome is Outcome.UNPATCHED and st.state in (State.NOT_NEEDED, State.OUT_OF_RANGE):
        attention.append(f"{pid}: {text}: the record says otherwise; update it")
    elif outcome is Outcome.UNPATCHED and st.state is State.UNVERIFIED:
        attention.append(f"{pid}: {text}: no verdict in this process; run `python -m kvpatch verify`")
    elif outcome is Outcome.ABSENT and st.state is State.APPLIED:
        attention.append(f"{pid}: applied, but the bug is absent upstream: update the record")


#: States that are facts about this environment needing attention: ``--check`` exits 2 on these...
_FAILING = {State.FAILED.value, State.TARGET_MISSING.value}
#: ... and 1 on these.
_ATTENTION = {State.DRIFTED.value, State.OVERRIDDEN.value}


def auto_activation() -> str | None:
    """Why kvpatch's ``.pth`` start-up hook does not run in this interpreter (``None``: it does), e.g. a
    ``pip install --target`` directory on ``PYTHONPATH``, which ``site`` does not process."""
    # The bootstrap notes the start-up sys.path when kvpatch.pth / kvpatch.start hand over to it; before the first
    # mlx import the .pth's stand-in finder is on sys.meta_path instead (kvpatch.config loads _kvpatch_boot too).
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


def _entry(p: Patch, st: PatchStatus) -> dict[str, Any]:
    review_by = p.expiry.review_by.isoformat() if p.expiry.review_by else None
    return {
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
        "expiry": {"condition": p.expiry.condition, "review_by": review_by, "overdue": p.expiry.overdue()},
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


def _build_report(engine: Engine, *, verify: bool, settle: bool, fresh: bool) -> Report:
    records = engine.materialise()  # the report shows every record
    settled = None
    if settle and not verify:
        from .settle import settle as settle_outcomes

        settled = settle_outcomes(engine, fresh=fresh)
    else:
        engine.refresh()
    relevant = [pid for pid, st in engine.status.items() if st.state not in (State.OUT_OF_RANGE, State.NOT_INSTALLED)]
    if verify:  # the hooks install what applies (and settle the verdict of what the reproduction decides)
        for pid in relevant:
            with contextlib.suppress(Exception):  # reported per patch by _verify
                import_target_modules(engine.record_of(engine.status[pid]))
    patches: list[dict[str, Any]] = []
    failed: list[str] = []
    attention: list[str] = []
    outcomes: dict[str, Outcome] = {}
    for p in records:
        st = engine.status[p.id]
        entry = _entry(p, st)
        if st.decision.action is Action.VERIFY:  # the stored verdict, read without importing upstream
            stored = verdicts.lookup(verdicts.key(p, engine.upstream))
            if stored is not None:
                entry["verdict"], entry["verdict_file"] = stored.describe(), stored.source or None
        if settled is not None and settled.how == "cache" and p.id in settled.outcomes:
            entry.update({k: settled.outcomes[p.id].get(k, entry[k]) for k in ("state", "reason", "error", "notes")})
        if verify and p.id in relevant:
            outcomes[p.id], entry["verify"] = _verify(engine, st)
            entry["state"], entry["reason"] = st.state.value, st.reason
            _verify_reasons(p.id, st, outcomes[p.id], entry["verify"]["outcome"], failed, attention)
        state = entry["state"]
        if state in _FAILING:
            failed.append(f"{p.id}: {entry['reason']}")
        elif state in _ATTENTION:
            attention.append(f"{p.id}: {state}: {entry['reason']}")
        elif state == State.INCONCLUSIVE.value:
            attention.append(f"{p.id}: inconclusive here, not applied (not a record error): {entry['error']}")
        elif state == State.UNVERIFIED.value or (
            state == State.PENDING.value and st.decision.action is Action.VERIFY and not entry["verdict"]
        ):
            attention.append(f"{p.id}: pending verification (no verdict for this environment): run `kvpatch verify`")
        elif st.drift and st.state is State.APPLIED:
            attention.append(f"{p.id}: applied to drifted code (reproduction confirmed); validate and record it")
        patches.append(entry)
    failed.extend(f"{module}: could not be loaded: {error}" for module, error in engine.broken.items())
    copies = []  # one entry per (patch, vendored copy a server registered)
    for cst in _copy_records():
        pid, state = cst.patch.id, cst.state.value
        copies.append({"id": pid, "copy": cst.copy, "state": state, "reason": cst.reason, "error": cst.error})
        if state in _FAILING:
            failed.append(f"{pid} in {cst.copy}: {cst.reason}")
        elif state in _ATTENTION or cst.state is State.UNVERIFIED:
            attention.append(f"{pid} in {cst.copy}: {state}: {cst.reason}")
    if engine.config.enforce:
        # Review-by dates are the project's own deadlines: they fail kvpatch's CI (KVPATCH_ENFORCE=1), never an
        # operator's health check on a day when nothing changed in the environment.
        attention.extend(
            f"{e['id']}: review-by date {e['expiry']['review_by']} has passed ({e['expiry']['condition']}): run "
            "`python -m kvpatch upstream-check`, then retire the patch or set a new Expiry(review_by=...)"
            for e in patches
            if e["expiry"]["overdue"]
        )
    attention.extend(engine.config.problems)
    data: dict[str, Any] = {
        "schema": "kvpatch.status/1",
        "kvpatch": __version__,
        "python": platform.python_version(),
        "platform": sys.platform,
        "enabled": engine.config.enabled,
        "upstream": {name: _upstream_entry(up) for name, up in engine.upstream.items()},
        "settled": None if settled is None else {"how": settled.how, "at": settled.at},
        "auto_activation": auto_activation(),
        "patches": patches,
        **({"copies": copies} if copies else {}),
        "broken": dict(engine.broken),
        "problems": list(engine.config.problems),
        "summary": dict(Counter(e["state"] for e in patches)),
        "check": {"exit": 2 if failed else 1 if attention else 0, "reasons": failed + attention},
    }
    return Report(data, outcomes)


def _upstream_entry(up: Upstream) -> dict[str, Any]:
    """One distribution in the JSON report (``upstream.<name>``)."""
    source = {"kind": up.source.kind, "url": up.source.url, "commit": up.source.commit, "error": up.source.error}
    return {"version": up.version, "installed": up.installed, "version_unknown": up.version_unknown, "source": source}


# -- text ---------------------------------------------------------------------------------------------

#: States shown in the compact view only as a count in the summary line.
_QUIET_STATES = frozenset({State.NOT_NEEDED.value, State.OUT_OF_RANGE.value, State.NOT_INSTALLED.value})

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
#: How many patch ids a count names ("1 skipped (offset-detach)") before it says "...".
_NAMED_IDS = 4


def cut(text: str, width: int | None) -> str:
    """``text`` cut to ``width`` (``None``: never cut, for pipes and logs)."""
    if width is None or len(text) <= width:
        return text
    return text[: max(width - 3, 10)] + "..."


def wrapped(text: str, indent: str, width: int | None, hang: str = "  ") -> list[str]:
    """``text`` wrapped after ``indent`` (continuation lines under it, plus ``hang``); a word longer than the
    line (a URL, a dotted target name) is kept whole."""
    return textwrap.wrap(
        text,
        width=max(width or 120, len(indent) + 40),
        initial_indent=indent,
        subsequent_indent=" " * len(indent) + hang,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [indent.rstrip()]


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
    lines = _header(d, report.outcomes)
    if verbose or width is not None:  # each line wrapped under its own indentation
        lines = [
            part
            for line in lines
            for part in wrapped(line.lstrip(" "), " " * (len(line) - len(line.lstrip(" "))), width or 80)
        ]
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


def _header(d: dict[str, Any], outcomes: dict[str, Outcome]) -> list[str]:
    off = "" if d["enabled"] else ": OFF (KVPATCH=off), nothing is patched"
    lines = [f"kvpatch {d['kvpatch']} on Python {d['python']} ({d['platform']}){off}"]
    if d.get("auto_activation"):
        lines.append(f"auto-activation: {d['auto_activation']}")
    shown, notes = [], []
    for name, up in d["upstream"].items():
        src = up["source"]
        if up["version"] is None and (up.get("version_unknown") or up.get("installed")):
            shown.append(f"{name} (version unknown)")
            why = up.get("version_unknown")
            notes.append(f"  {name}: installed, version unknown ({why}): the reproduction decides")
        elif up["version"] is None:
            shown.append(f"{name} not installed")
        else:
            shown.append(f"{name} {up['version']}")
            if src["kind"] not in ("index", "none"):
                where = f"{src['kind']} install" + (f" {src['url']}" if src["url"] else "")
                where += f"@{src['commit'][:12]}" if src["commit"] else ""
                notes.append(f"  {name}: {where}" + (f" [{src['error']}]" if src["error"] else ""))
    lines.append("upstream: " + ", ".join(shown))
    lines.extend(notes)
    lines.append(f"{len(d['patches'])} patches: {_state_counts(d)}" if d["patches"] else "no patches loaded")
    # --verify's outcomes by count; a skipped reproduction names its patches (a skip hides a check)
    ids: dict[str, list[str]] = {}
    for e in d["patches"]:
        if e.get("verify"):
            skipped = outcomes.get(e["id"]) is Outcome.SKIPPED
            ids.setdefault("skipped" if skipped else str(e["verify"].get("outcome") or ""), []).append(e["id"])
    counts = []
    for key, named in sorted(ids.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        shown_ids = ", ".join(named[:_NAMED_IDS]) + (", ..." if len(named) > _NAMED_IDS else "")
        counts.append(
            f"{len(named)} {key}" + (f" ({shown_ids}: `kvpatch status -v` says why)" if key == "skipped" else "")
        )
    if counts:
        lines.append("verified: " + "; ".join(counts))
    return lines


def _state_counts(d: dict[str, Any]) -> str:
    """``"13 not needed, 11 pending, 25 for mlx-vlm (not installed)"``: patches by state, the ones whose
    package is absent by package (so "not installed" cannot read as "failed to install")."""
    counts = {s: n for s, n in d["summary"].items() if s != State.NOT_INSTALLED.value}
    parts = [f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    absent = _not_installed(d["patches"])
    parts.extend(f"{n} for {dist} (not installed)" for dist, n in absent.items())
    return ", ".join(parts)


def _not_installed(entries: list[dict[str, Any]]) -> Counter[str]:
    """How many patches each distribution that is not installed has."""
    return Counter(e["distribution"] for e in entries if e["state"] == State.NOT_INSTALLED.value)


def _compact(d: dict[str, Any], outcomes: dict[str, Outcome], width: int | None) -> list[str]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for e in d["patches"]:
        state = _state_text(e)
        if state in _QUIET_STATES and not _notable_verify(e, outcomes):
            continue
        groups.setdefault(state, []).append(e)
    if not groups:
        if not any(d["upstream"][name]["installed"] for name in ("mlx-lm", "mlx-vlm") if name in d["upstream"]):
            return ["nothing to patch here: neither mlx-lm nor mlx-vlm is installed", ""]
        return ["nothing to patch here: every patch is fixed upstream or predates this release", ""]
    pad = max(len(e["id"]) for es in groups.values() for e in es)
    under = " " * (pad + 4)
    lines: list[str] = []
    for state in sorted(groups, key=lambda s: _RANK.get(s, _ATTENTION_END)):
        entries = groups[state]
        lines.append(f"{dict(_GROUPS).get(state, state)} ({len(entries)}):")
        if state == "disabled":
            lines.extend(wrapped(", ".join(e["id"] for e in entries), "  ", width))
            lines.append("")
            continue
        explained = state in _QUIET_STATES or _RANK.get(state, _ATTENTION_END) <= _ATTENTION_END
        shared = explained and len(entries) > 1 and len({e["reason"] for e in entries}) == 1
        if shared:  # one reason for the whole group (a distribution whose version is unknown): say it once
            lines.extend(wrapped(f"all {len(entries)}: {entries[0]['reason']}", "  ", width))
        for e in entries:
            lines.append(cut(f"  {e['id']:<{pad}}  {e['summary']}", width))
            if explained and not shared:
                lines.extend(wrapped(f"{state}: {e['reason']}", under, width))
                if e.get("error") and e["error"] not in e["reason"]:
                    lines.extend(wrapped(f"error: {e['error']}", under, width))
            elif state == "opt-in":
                lines.append(f"{under}turn it on: KVPATCH_ENABLE={e['id']}")
            notable = _notable_verify(e, outcomes)
            if notable:
                lines.extend(wrapped(f"verify: {notable}", under, width))
        lines.append("")
    return lines


def _full_table(d: dict[str, Any], width: int) -> list[str]:
    """Every present patch: its id and state, then its details, each wrapped to ``width``; a distribution that
    is not installed is one line, not one per patch."""
    present = [e for e in d["patches"] if e["state"] != State.NOT_INSTALLED.value]
    lines: list[str] = []
    pad = max((len(e["id"]) for e in present), default=0)
    for e in present:
        lines.append(f"{e['id']:<{pad}}  {_state_text(e)}")
        if e["fixed_in"]:
            fixed = e["fixed_in"] + (f" ({e['fixed_commit'][:8]})" if e["fixed_commit"] else "")
        else:
            fixed = f"not fixed as of {e['checked_through']}" if e["checked_through"] else "not fixed"
        details = [("affected", e["affected"]), ("fixed in", fixed), ("target", ", ".join(e["targets"]))]
        details.append(("why", e["reason"]))
        if e.get("verdict_file"):
            details.append(("verdict", e["verdict_file"]))
        if e.get("error") and e["error"] not in e["reason"]:
            details.append(("error", e["error"]))
        if e["verify"]:
            details.append(("verify", str(e["verify"]["outcome"])))
        details.append(("reference", e["reference"]))
        for label, text in details:
            lines.extend(wrapped(text, f"    {label + ':':<11}", width, hang=""))
    absent = _not_installed(d["patches"])
    if absent and lines:
        lines.append("")
    lines.extend(f"{dist} not installed: its {n} patches do not apply" for dist, n in absent.items())
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
