"""The audit behind ``kvpatch status``: every patch's state and why, and the check's exit status. The JSON form
follows ``kvpatch/data/status.schema.json`` (``kvpatch.status/1``: keys are added, never removed or renamed)."""

from __future__ import annotations

import contextlib
import platform
import sys
import textwrap
from collections import Counter
from typing import Any, NamedTuple

from . import __version__, _copy_records, measurer, verdicts
from ._warn import failure
from .engine import Engine, PatchStatus, State, import_target_modules
from .gate import Action
from .record import Bug, Finding, Patch
from .settle import settle as settle_outcomes
from .verdicts import Outcome

__all__ = ["Report", "build_report", "format_text"]


class Report(NamedTuple):
    data: dict[str, Any]
    outcomes: dict[str, Outcome]  # patch id -> the ``--verify`` outcome (``data`` says it in words)
    #: patch id -> how far its verdict's sizes are from the rounding (:func:`kvpatch.verdicts.margin`), from this
    #: run's measurement or the stored verdict; only reproductions that compare computed numbers have one
    margins: dict[str, str] | None = None


#: States that are facts about this environment needing attention: ``--check`` exits 2 on these, 1 on the others.
_FAILING, _ATTENTION = {State.FAILED.value, State.TARGET_MISSING.value}, {State.DRIFTED.value, State.OVERRIDDEN.value}


def _finding(f: Finding | None) -> dict[str, Any] | None:
    keys = ("detail", "skipped", "inconclusive")  # "verdict": the schema's name for Finding.bug
    return None if f is None else {"present": f.present, "verdict": f.bug.value} | {k: getattr(f, k) for k in keys}


def _verify(
    engine: Engine, st: PatchStatus, check: dict[int, list[str]], margins: dict[str, str]
) -> tuple[Outcome, dict[str, Any]]:
    """The patch's measurement (the engine's own when it settled a verdict here: each side runs once), how the report
    says it, its margin and its check reasons (only a conclusive finding on upstream's own code says the record is
    wrong)."""
    try:
        m = st.measurement or engine.measure(engine.record_of(st), install=False)
    except Exception as exc:
        outcome, text = Outcome.COULD_NOT_RUN, f"{Outcome.COULD_NOT_RUN.value}: {failure(exc)}"
        found: dict[str, Any] = {"without_patch": None, "with_patch": None, "foreign": []}
    else:
        applied = st.state is State.APPLIED
        outcome, detail = m.outcome(applied)
        text = {
            Outcome.SKIPPED: f"skipped: {detail}",
            Outcome.ELSEWHERE: f"{outcome.value} ({detail})",
            Outcome.UNPATCHED: f"{outcome.value} ({st.state.value})",
        }.get(outcome, outcome.value)
        if outcome is Outcome.INCONCLUSIVE:  # the patch was tried unless the run without it was inconclusive
            tried = m.after if m.before.bug is not Bug.INCONCLUSIVE else None
            text += f" with the patch: {tried.inconclusive or tried.skipped}" if tried else f" {detail}"
        found = {"without_patch": _finding(m.before), "with_patch": _finding(m.after if applied else None)}
        found["foreign"] = list(m.foreign)
        if said := verdicts.margin(verdicts.sizes_of(m.before, m.after if applied else None)):
            margins[st.patch.id] = said
    pid = st.patch.id
    if outcome is Outcome.NOT_FIXED:
        check[2].append(f"{pid}: {text}")
    elif outcome is Outcome.COULD_NOT_RUN:
        check[1].append(f"{pid}: verify {text} (this environment needs attention; not a record error)")
    elif outcome is Outcome.INCONCLUSIVE:
        check[1].append(f"{pid}: verify {text} (an error that is not the bug: this environment needs attention)")
    elif outcome is Outcome.UNPATCHED and st.state in (State.NOT_NEEDED, State.OUT_OF_RANGE):
        check[1].append(f"{pid}: {text}: the record says otherwise; update it")
    elif outcome is Outcome.UNPATCHED and st.state is State.UNVERIFIED:
        check[1].append(f"{pid}: {text}: no verdict in this process; run `python -m kvpatch verify`")
    elif outcome is Outcome.ABSENT and st.state is State.APPLIED:
        check[1].append(f"{pid}: applied, but the bug is absent upstream: update the record")
    return outcome, {"outcome": text, **found}


def auto_activation() -> str | None:
    """Why kvpatch's ``.pth`` start-up hook does not run in this interpreter (``None``: it does)."""
    # the bootstrap notes the start-up sys.path; before the first mlx import the .pth's finder stands in for it
    if getattr(sys.modules.get("_kvpatch_boot"), "_startup_path", None) is not None or any(
        getattr(f, "__name__", type(f).__name__) == "KvpatchBootstrapFinder" for f in sys.meta_path
    ):
        return None
    why = "kvpatch.pth is not in a site directory of this interpreter (a --target install on PYTHONPATH?)"
    why = "this interpreter runs without site (-S)" if sys.flags.no_site else why
    return f"off: {why}; use `import kvpatch` or `kvpatch run`"


def _entry(p: Patch, st: PatchStatus) -> dict[str, Any]:
    entry = {k: getattr(p, k) for k in ("id", "summary", "distribution", "catalogue")}
    entry["targets"] = [t.path for t in p.targets]
    entry |= {k: getattr(p, k) for k in ("affected", "fixed_in", "fixed_commit", "checked_through", "reference")}
    entry |= {"hot_path": p.hot_path, "metal_only": p.metal_only}
    review_by = p.expiry.review_by.isoformat() if p.expiry.review_by else None
    entry["expiry"] = {"condition": p.expiry.condition, "review_by": review_by, "overdue": p.expiry.overdue()}
    entry |= {"action": st.decision.action.value, "state": st.state.value, "reason": st.reason, "error": st.error}
    entry |= {"drift": list(st.drift), "verified": st.verified, "notes": list(st.notes), "wrapped": list(st.wrapped)}
    return entry | {"opt_in": p.opt_in, "verdict": None, "verdict_file": None, "verify": None}


def build_report(engine: Engine, *, verify: bool = False, settle: bool = True, fresh: bool = False) -> Report:
    """The audit. ``settle`` (default): outcomes, not predictions (see :mod:`kvpatch.settle`)."""
    with measurer.measuring_as("status --verify", remeasure=True) if verify else contextlib.nullcontext():
        records = engine.materialise()  # the report shows every record
        settled = settle_outcomes(engine, fresh=fresh) if settle and not verify else None
        if settled is None:
            engine.refresh()
        skip = (State.OUT_OF_RANGE, State.NOT_INSTALLED)
        relevant = {pid for pid, st in engine.status.items() if st.state not in skip}
        if verify:  # the hooks install what applies (and settle the verdict of what the reproduction decides)
            for pid in relevant:
                with contextlib.suppress(Exception):  # reported per patch by _verify
                    import_target_modules(engine.record_of(engine.status[pid]))
        patches: list[dict[str, Any]] = []
        check: dict[int, list[str]] = {2: [], 1: []}  # the check's reasons: 2 a patch failed, 1 attention
        outcomes: dict[str, Outcome] = {}
        margins: dict[str, str] = {}
        for p in records:
            st = engine.status[p.id]
            entry = _entry(p, st)
            if st.decision.action is Action.VERIFY:  # the stored verdict, read without importing upstream
                stored = verdicts.lookup(verdicts.key(p, engine.upstream))
                if stored is not None:
                    entry["verdict"], entry["verdict_file"] = stored.describe(), stored.source or None
                    if said := verdicts.margin(stored.sizes):
                        margins[p.id] = said
            if settled is not None and settled.how == "cache" and p.id in settled.outcomes:
                entry |= {k: settled.outcomes[p.id].get(k, entry[k]) for k in ("state", "reason", "error", "notes")}
            if verify and p.id in relevant:
                outcomes[p.id], entry["verify"] = _verify(engine, st, check, margins)
                entry["state"], entry["reason"] = st.state.value, st.reason
            state = entry["state"]
            unsettled = state == State.PENDING.value and st.decision.action is Action.VERIFY and not entry["verdict"]
            if state in _FAILING:
                check[2].append(f"{p.id}: {entry['reason']}")
            elif state in _ATTENTION:
                check[1].append(f"{p.id}: {state}: {entry['reason']}")
            elif state == State.INCONCLUSIVE.value:
                check[1].append(f"{p.id}: inconclusive here, not applied (not a record error): {entry['error']}")
            elif state == State.UNVERIFIED.value or unsettled:
                check[1].append(f"{p.id}: pending verification (no verdict for this environment): run `kvpatch verify`")
            elif st.drift and st.state is State.APPLIED:
                check[1].append(f"{p.id}: applied to drifted code (reproduction confirmed); validate and record it")
            patches.append(entry)
        check[2].extend(f"{module}: could not be loaded: {error}" for module, error in engine.broken.items())
        copies = []  # one entry per (patch, vendored copy a server registered)
        for c in _copy_records():
            who, state = f"{c.patch.id} in {c.copy}", c.state.value
            copies.append({"id": c.patch.id, "copy": c.copy, "state": state, "reason": c.reason, "error": c.error})
            if state in _FAILING:
                check[2].append(f"{who}: {c.reason}")
            elif state in _ATTENTION or c.state is State.UNVERIFIED:
                check[1].append(f"{who}: {state}: {c.reason}")
    if engine.config.enforce:  # the project's own deadlines fail kvpatch's CI, never an operator's health check
        check[1].extend(
            f"{e['id']}: review-by date {e['expiry']['review_by']} has passed ({e['expiry']['condition']}): run "
            "`python -m kvpatch upstream-check`, then retire the patch or set a new Expiry(review_by=...)"
            for e in patches
            if e["expiry"]["overdue"]
        )
    check[1].extend(engine.config.problems)
    data: dict[str, Any] = {
        "schema": "kvpatch.status/1",
        "kvpatch": __version__,
        "python": platform.python_version(),
        "platform": sys.platform,
        "enabled": engine.config.enabled,
        "upstream": {
            name: {k: getattr(up, k) for k in ("version", "installed", "version_unknown")}
            | {"source": {k: getattr(up.source, k) for k in ("kind", "url", "commit", "error")}}
            for name, up in engine.upstream.items()
        },
        "settled": None if settled is None else {"how": settled.how, "at": settled.at},
        "auto_activation": auto_activation(),
        "patches": patches,
        **({"copies": copies} if copies else {}),
        "broken": dict(engine.broken),
        "problems": list(engine.config.problems),
        "summary": dict(Counter(e["state"] for e in patches)),
        "check": {"exit": 2 if check[2] else 1 if check[1] else 0, "reasons": check[2] + check[1]},
    }
    return Report(data, outcomes, margins)


#: States shown in the compact view only as a count in the summary line.
_QUIET_STATES = frozenset({State.NOT_NEEDED.value, State.OUT_OF_RANGE.value, State.NOT_INSTALLED.value})

#: How the compact view groups what it shows, attention first: state as ``_state_text`` says it -> title.
_GROUPS = {
    "failed": "FAILED: not applied, the bug is live",
    "target missing": "TARGET MISSING: upstream moved or removed what the patch replaces",
    "drifted": "DRIFTED: the target's code is not what the patch was validated on",
    "inconclusive": "INCONCLUSIVE: the reproduction could not tell",
    "pending verification": "pending verification: the reproduction decides",
    "overridden": "overridden",
    "opt-in": "opt-in available: off unless KVPATCH_ENABLE names it",
    "disabled": "disabled",
    "applied": "applied",
    "pending": "will apply when its module is imported",
}
_RANK = {state: i for i, state in enumerate(_GROUPS)}
#: Groups up to inconclusive give each patch's reason; a state missing from _GROUPS joins them, under its own name.
_EXPLAINED = _RANK["inconclusive"] + 0.5


def cut(text: str, width: int | None) -> str:
    """``text`` cut to ``width`` (``None``: never cut, for pipes and logs)."""
    return text if width is None or len(text) <= width else text[: max(width - 3, 10)] + "..."


def wrapped(text: str, indent: str, width: int | None, hang: str = "  ") -> list[str]:
    """``text`` wrapped after ``indent``; a word longer than the line (a URL, a dotted name) is kept whole."""
    return textwrap.wrap(
        text,
        width=max(width or 120, len(indent) + 40),
        initial_indent=indent,
        subsequent_indent=" " * len(indent) + hang,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [indent.rstrip()]


def _state_text(entry: dict[str, Any]) -> str:
    if entry["state"] != State.PENDING.value or entry["action"] == "apply":
        return str(entry["state"])
    return f"pending ({entry['verdict'].split(' (')[0]})" if entry["verdict"] else "pending verification"


def format_text(report: Report, *, verbose: bool = False, width: int | None = None, check: bool = False) -> str:
    """The text of ``kvpatch status``: compact, or every patch with ``verbose``. ``width`` cuts summaries to a terminal
    (``None``: never); ``verbose`` wraps every line to it (default 80). ``check``: the check line names the exit."""
    d, outcomes = report.data, report.outcomes
    absent = Counter(e["distribution"] for e in d["patches"] if e["state"] == State.NOT_INSTALLED.value)
    off = "" if d["enabled"] else ": OFF (KVPATCH=off), nothing is patched"
    lines = [f"kvpatch {d['kvpatch']} on Python {d['python']} ({d['platform']}){off}"]
    if d["auto_activation"]:
        lines.append(f"auto-activation: {d['auto_activation']}")
    shown, notes = [], []
    for name, up in d["upstream"].items():
        src, version = up["source"], up["version"]
        unknown = version is None and (up["version_unknown"] or up["installed"])
        shown.append(f"{name} (version unknown)" if unknown else f"{name} {version or 'not installed'}")
        if unknown:
            notes.append(f"  {name}: installed, version unknown ({up['version_unknown']}): the reproduction decides")
        elif version is not None and src["kind"] not in ("index", "none"):
            where = f"{src['kind']} install" + (f" {src['url']}" if src["url"] else "")
            where += f"@{src['commit'][:12]}" if src["commit"] else ""
            notes.append(f"  {name}: {where}" + (f" [{src['error']}]" if src["error"] else ""))
    lines += ["upstream: " + ", ".join(shown), *notes]
    # patches by state; those whose package is absent by package (so "not installed" cannot read as "failed")
    counts = sorted((-n, s) for s, n in d["summary"].items() if s != State.NOT_INSTALLED.value)
    parts = [f"{-n} {s}" for n, s in counts]
    parts += [f"{n} for {dist} (not installed)" for dist, n in absent.items()]
    lines.append(f"{len(d['patches'])} patches: {', '.join(parts)}" if d["patches"] else "no patches loaded")
    # --verify's outcomes by count; a skipped reproduction names its patches (a skip hides a check)
    ids: dict[str, list[str]] = {}
    for e in (e for e in d["patches"] if e["verify"]):
        key = "skipped" if outcomes.get(e["id"]) is Outcome.SKIPPED else str(e["verify"]["outcome"])
        ids.setdefault(key, []).append(e["id"])
    verified = []
    for key, named in sorted(ids.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        listed = ", ".join(named[:4]) + (", ..." if len(named) > 4 else "")
        why = f" ({listed}: `kvpatch status -v` says why)" if key == "skipped" else ""
        verified.append(f"{len(named)} {key}{why}")
    if verified:
        lines.append("verified: " + "; ".join(verified))
    if verbose or width is not None:  # each line wrapped under its own indentation
        lines = [w for ln in lines for w in wrapped(ln.lstrip(), ln[: len(ln) - len(ln.lstrip())], width or 80)]
    lines.append("")
    lines.extend(_full_table(d, width or 80, absent, report.margins or {}) if verbose else _compact(d, outcomes, width))
    reasons, code = d["check"]["reasons"], d["check"]["exit"]  # broken modules and config problems among them
    if not reasons:
        lines.append(f"check: clean (exit {code})" if check else "check: clean, nothing needs attention")
    else:  # the exit status is named only to a command that asked for one
        what = "attention needed" if code == 1 else "a patch failed or did not fix its bug"
        exits = f"exit {code}" if check else f"`kvpatch status --check` exits {code}"
        lines.append(f"check: {what} ({exits}):")
        fit = verbose or width is not None  # wrapped as the lines above are
        lines += [w for r in reasons for w in (wrapped(r, "  - ", width or 80, hang="") if fit else [f"  - {r}"])]
    if not verbose:
        lines.append("`kvpatch status -v` lists every patch with its targets and reason.")
    return "\n".join(lines)


def _compact(d: dict[str, Any], outcomes: dict[str, Outcome], width: int | None) -> list[str]:
    notable = {  # the verify outcomes that say something new about a patch's state
        e["id"]: e["verify"]["outcome"]
        for e in d["patches"]
        if e["verify"] and outcomes.get(e["id"]) not in (Outcome.FIXED, Outcome.ABSENT, Outcome.SKIPPED)
    }
    groups: dict[str, list[dict[str, Any]]] = {}
    for e in d["patches"]:
        state = _state_text(e)
        if state not in _QUIET_STATES or e["id"] in notable:
            groups.setdefault(state, []).append(e)
    if not groups:
        if not any(d["upstream"][name]["installed"] for name in ("mlx-lm", "mlx-vlm") if name in d["upstream"]):
            return ["nothing to patch here: neither mlx-lm nor mlx-vlm is installed", ""]
        return ["nothing to patch here: every patch is fixed upstream or predates this release", ""]
    pad = max(len(e["id"]) for es in groups.values() for e in es)
    under = " " * (pad + 4)
    lines: list[str] = []
    for state in sorted(groups, key=lambda s: _RANK.get(s, _EXPLAINED)):
        entries = groups[state]
        lines.append(f"{_GROUPS.get(state, state)} ({len(entries)}):")
        if state == "disabled":
            lines += [*wrapped(", ".join(e["id"] for e in entries), "  ", width), ""]
            continue
        explained = _RANK.get(state, _EXPLAINED) <= _EXPLAINED
        shared = explained and len(entries) > 1 and len({e["reason"] for e in entries}) == 1
        if shared:  # one reason for the whole group: say it once
            lines.extend(wrapped(f"all {len(entries)}: {entries[0]['reason']}", "  ", width))
        for e in entries:
            lines.append(cut(f"  {e['id']:<{pad}}  {e['summary']}", width))
            if explained and not shared:
                lines.extend(wrapped(f"{state}: {e['reason']}", under, width))
                if e["error"] and e["error"] not in e["reason"]:
                    lines.extend(wrapped(f"error: {e['error']}", under, width))
            elif state == "opt-in":
                lines.append(f"{under}turn it on: KVPATCH_ENABLE={e['id']}")
            if e["id"] in notable:
                lines.extend(wrapped(f"verify: {notable[e['id']]}", under, width))
        lines.append("")
    return lines


def _full_table(d: dict[str, Any], width: int, absent: Counter[str], margins: dict[str, str]) -> list[str]:
    """Every present patch with its details; a distribution that is not installed is one line, not one per patch."""
    present = [e for e in d["patches"] if e["state"] != State.NOT_INSTALLED.value]
    lines: list[str] = []
    pad = max((len(e["id"]) for e in present), default=0)
    for e in present:
        lines.append(f"{e['id']:<{pad}}  {_state_text(e)}")
        fixed = f"not fixed as of {e['checked_through']}" if e["checked_through"] else "not fixed"
        if e["fixed_in"]:
            fixed = e["fixed_in"] + (f" ({e['fixed_commit'][:8]})" if e["fixed_commit"] else "")
        details = [("affected", e["affected"]), ("fixed in", fixed), ("target", ", ".join(e["targets"]))]
        details += [("why", e["reason"]), ("verdict", e["verdict_file"])]
        details += [("error", e["error"] if e["error"] and e["error"] not in e["reason"] else None)]
        details += [("verify", e["verify"] and str(e["verify"]["outcome"])), ("margin", margins.get(e["id"]))]
        details += [("reference", e["reference"])]
        for label, text in details:
            if text is not None:
                lines.extend(wrapped(text, f"    {label + ':':<11}", width, hang=""))
    if absent and lines:
        lines.append("")
    lines.extend(f"{dist} not installed: its {n} patches do not apply" for dist, n in absent.items())
    lines.append("")
    return lines
