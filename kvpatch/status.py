"""The audit behind ``kvpatch status``: every patch's state and why, and the check's exit status, as the state
table says them (:mod:`kvpatch.states`). The JSON form follows ``kvpatch/data/status.schema.json``
(``kvpatch.status/1``: keys are added, never removed or renamed)."""

from __future__ import annotations

import contextlib
import platform
import sys
import textwrap
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, NamedTuple

from . import __version__, _copy_records, verdicts
from ._warn import failure
from .engine import Engine, PatchStatus, State, import_target_modules
from .gate import Action, misplaced
from .record import Bug, Finding, Patch
from .settle import settle as settle_outcomes
from .states import AWAITING, EXPLAINED, MEANINGS, Check, Meaning, Outcome, Reason, found, verify_check
from .verifier import Verifier

__all__ = ["Report", "build_report", "format_text"]


class Report(NamedTuple):
    data: dict[str, Any]
    outcomes: dict[str, Outcome]  # patch id -> the ``--verify`` outcome (``data`` says it in words)
    #: patch id -> how far its verdict's sizes are from the rounding (:func:`kvpatch.verdicts.margin`), from this
    #: run's measurement or the stored verdict; only reproductions that compare computed numbers have one
    margins: dict[str, str] | None = None
    stored: dict[str, Outcome] | None = None  # patch id -> its stored verdict's outcome (``data`` says it in words)
    attention: frozenset[str] = frozenset()  # the patches a check reason names: the compact view lists each


#: Each state's meaning by the name ``status --json`` gives it.
_MEANING = {state.value: meaning for state, meaning in MEANINGS.items()}
_NOTHING_TO_PATCH = {State.NOT_NEEDED.value, State.OUT_OF_RANGE.value, State.NOT_INSTALLED.value}


def _finding(f: Finding | None) -> dict[str, Any] | None:
    keys = ("detail", "skipped", "inconclusive")  # "verdict": the schema's name for Finding.bug
    return None if f is None else {"present": f.present, "verdict": f.bug.value} | {k: getattr(f, k) for k in keys}


def _verify(
    engine: Engine, st: PatchStatus, check: dict[Check, list[Reason]], margins: dict[str, str]
) -> tuple[Outcome, dict[str, Any]]:
    """The patch's measurement (the verifier's, where it settled a verdict here: each side runs once), how the report
    says it, its margin and what it gives the check (only a conclusive finding on upstream's own code says the record
    is wrong, and which field)."""
    found_: dict[str, Any] = {"without_patch": None, "with_patch": None, "foreign": []}
    try:
        m = st.measurement or engine.measure(st.record, install=False)
    except Exception as exc:
        outcome, said = Outcome.COULD_NOT_RUN, found(Outcome.COULD_NOT_RUN, failure(exc))
    else:
        after = m.after if st.state is State.APPLIED else None
        outcome, detail = verdicts.judge(m.before, after, m.foreign)
        tried = m.after if m.before.bug is not Bug.INCONCLUSIVE else None  # the patch was tried: what it hit
        said = found(outcome, detail, state=st.state, tried=(tried.inconclusive or tried.skipped) if tried else None)
        found_ = {"without_patch": _finding(m.before), "with_patch": _finding(after), "foreign": list(m.foreign)}
        if size := verdicts.margin(verdicts.sizes_of(m.before, after)):
            margins[st.patch.id] = size
    up = engine.upstream[st.patch.distribution]
    field = misplaced(st.record, up.version, up.source.commit, st.decision.action)
    level, why = verify_check(st.patch.id, outcome, said, st.state, field)
    if why is not None:
        check[level].append(why)
    return outcome, {"outcome": str(said), **found_}


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
    record = ("affected", "fixed_in", "fixed_commit", "checked_through", "reference", "hot_path", "metal_only")
    entry |= {k: getattr(p, k) for k in record}
    review_by = p.expiry.review_by.isoformat() if p.expiry.review_by else None
    entry["expiry"] = {"condition": p.expiry.condition, "review_by": review_by, "overdue": p.expiry.overdue()}
    entry |= {"action": st.decision.action.value, "state": st.state.value, "reason": st.reason, "error": st.error}
    entry |= {"drift": list(st.drift), "verified": st.verified, "notes": list(st.notes), "wrapped": list(st.wrapped)}
    return entry | {"opt_in": p.opt_in, "verdict": None, "verdict_file": None, "verify": None}


def build_report(engine: Engine, *, verify: bool = False, settle: bool = True, fresh: bool = False) -> Report:
    """The audit. ``settle`` (default): outcomes, not predictions (see :mod:`kvpatch.settle`). ``verify``: each
    relevant patch's reproduction measured too, a :class:`~kvpatch.verifier.Verifier` settling first those it
    decides here."""
    records = engine.materialise()  # the report shows every record
    settled = settle_outcomes(engine, fresh=fresh) if settle and not verify else None
    if settled is None:
        engine.refresh()
    skip = (State.OUT_OF_RANGE, State.NOT_INSTALLED)
    relevant = [p for p in records if engine.status[p.id].state not in skip]
    if verify:  # every relevant target imported (the hooks install what is decided), then verified
        for p in relevant:
            with contextlib.suppress(Exception):  # reported per patch by _verify
                import_target_modules(p)
        Verifier(engine, "status --verify").run(relevant)
    patches: list[dict[str, Any]] = []
    check: dict[Check, list[Reason]] = {Check.FAILURE: [], Check.ATTENTION: []}
    outcomes: dict[str, Outcome] = {}
    margins: dict[str, str] = {}
    stored: dict[str, Outcome] = {}
    for p in records:
        st = engine.status[p.id]
        entry = _entry(p, st)
        if st.decision.action is Action.VERIFY:  # the stored verdict, read without importing upstream
            verdict = verdicts.lookup(verdicts.key(p, engine.upstream))
            if verdict is not None:
                entry["verdict"], entry["verdict_file"] = verdict.describe(), verdict.source or None
                stored[p.id] = verdict.outcome
                if said := verdicts.margin(verdict.sizes):
                    margins[p.id] = said
        if settled is not None and settled.how == "cache" and p.id in settled.outcomes:
            entry |= {k: settled.outcomes[p.id].get(k, entry[k]) for k in ("state", "reason", "error", "notes")}
        if verify and p in relevant:
            outcomes[p.id], entry["verify"] = _verify(engine, st, check, margins)
            entry["state"], entry["reason"] = st.state.value, st.reason
        meaning = _shown(entry, stored)[1]
        if meaning.check:
            facts = {k: entry[k] for k in ("id", "state", "reason", "error")}
            check[meaning.check].append(Reason(meaning.line, **facts))
        elif st.drift and st.state is State.APPLIED:
            check[Check.ATTENTION].append(Reason("check-drift", id=p.id))
        patches.append(entry)
    check[Check.FAILURE] += [Reason("check-broken", module=m, error=e) for m, e in engine.broken.items()]
    copies = []  # one entry per (patch, vendored copy a server registered)
    for c in _copy_records():
        copies.append({"id": c.patch.id, "copy": c.copy, "state": c.state.value, "reason": c.reason, "error": c.error})
        if level := MEANINGS[c.state].check:
            code = "check-failing" if level is Check.FAILURE else "check-state"
            check[level].append(Reason(code, id=f"{c.patch.id} in {c.copy}", state=c.state.value, reason=c.reason))
    if engine.config.enforce:  # the project's own deadlines fail kvpatch's CI, never an operator's health check
        check[Check.ATTENTION] += [
            Reason("check-overdue", id=e["id"], **e["expiry"]) for e in patches if e["expiry"]["overdue"]
        ]
    check[Check.ATTENTION] += [Reason("check-problem", problem=problem) for problem in engine.config.problems]
    reasons = check[Check.FAILURE] + check[Check.ATTENTION]
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
        "check": {
            "exit": max((c for c, why in check.items() if why), default=Check.CLEAN).value,
            "reasons": [str(why) for why in reasons],
        },
    }
    return Report(data, outcomes, margins, stored, frozenset(str(r.facts["id"]) for r in reasons if "id" in r.facts))


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


def _some(ids: Iterable[str]) -> str:
    """The first four of ``ids``: a line that names patches stays one line however many there are."""
    ids = list(ids)
    return ", ".join(ids[:4]) + (", ..." if len(ids) > 4 else "")


def _shown(entry: dict[str, Any], stored: dict[str, Outcome]) -> tuple[str, Meaning]:
    """How the views name a patch's state, with its meaning: a pending patch its reproduction decides is shown by its
    stored verdict, and without one as pending verification (``--no-settle``: a prediction)."""
    state = entry["state"]
    if state != State.PENDING.value or entry["action"] == Action.APPLY.value:
        # a state this kvpatch does not know (a settled outcome's): shown by its name, with the explained ones
        return state, _MEANING.get(state) or Meaning(EXPLAINED, state, "")
    if entry["id"] in stored:
        awaiting = replace(AWAITING, title=AWAITING.title.format(outcome=stored[entry["id"]].value))
        return awaiting.title, awaiting
    return State.UNVERIFIED.value, MEANINGS[State.UNVERIFIED]


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
        why = f" ({_some(named)}: `kvpatch status -v` says why)" if key == "skipped" else ""
        verified.append(f"{len(named)} {key}{why}")
    if verified:
        lines.append("verified: " + "; ".join(verified))
    if verbose or width is not None:  # each line wrapped under its own indentation
        lines = [w for ln in lines for w in wrapped(ln.lstrip(), ln[: len(ln) - len(ln.lstrip())], width or 80)]
    lines.append("")
    lines.extend(_full_table(report, width or 80, absent) if verbose else _compact(report, width))
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


def _compact(report: Report, width: int | None) -> list[str]:
    """One line per patch that needs attention (a check reason names it), attention first; a state that needs none is
    counted in the summary line only (``quiet``) or, the user's to choose, named in one line: the view does not
    grow with the catalogue."""
    d, outcomes, stored = report.data, report.outcomes, report.stored or {}
    groups: dict[str, list[dict[str, Any]]] = {}
    meanings: dict[str, Meaning] = {}
    for e in d["patches"]:
        state, meanings[state] = _shown(e, stored)
        groups.setdefault(state, []).append(e)
    if all(e["state"] in _NOTHING_TO_PATCH for e in d["patches"]):
        if not any(d["upstream"][name]["installed"] for name in ("mlx-lm", "mlx-vlm") if name in d["upstream"]):
            return ["nothing to patch here: neither mlx-lm nor mlx-vlm is installed", ""]
        return ["nothing to patch here: every patch is fixed upstream or predates this release", ""]
    listed = {state: [e for e in entries if e["id"] in report.attention] for state, entries in groups.items()}
    pad = max((len(e["id"]) for entries in listed.values() for e in entries), default=0)
    under = " " * (pad + 4)
    lines: list[str] = []
    for state in sorted(groups, key=lambda s: meanings[s].rank):
        entries, meaning, named = groups[state], meanings[state], listed[state]
        if not named:
            if not meaning.quiet:
                ids = _some(e["id"] for e in entries)
                lines += [*wrapped(f"{meaning.title} ({len(entries)}): {ids}", "", width), ""]
            continue
        count = f"{len(named)} of {len(entries)}" if len(named) < len(entries) else len(named)
        lines.append(f"{meaning.title} ({count}):")
        explained = meaning.rank <= EXPLAINED
        shared = explained and len(named) > 1 and len({e["reason"] for e in named}) == 1
        if shared:  # one reason for the whole group: say it once
            lines.extend(wrapped(f"all {len(named)}: {named[0]['reason']}", "  ", width))
        for e in named:
            lines.append(cut(f"  {e['id']:<{pad}}  {e['summary']}", width))
            if explained and not shared:
                lines.extend(wrapped(f"{state}: {e['reason']}", under, width))
                if e["error"] and e["error"] not in e["reason"]:
                    lines.extend(wrapped(f"error: {e['error']}", under, width))
            if e["verify"] and outcomes.get(e["id"]) not in (Outcome.FIXED, Outcome.ABSENT, Outcome.SKIPPED):
                lines.extend(wrapped(f"verify: {e['verify']['outcome']}", under, width))
        lines.append("")
    return lines


def _full_table(report: Report, width: int, absent: Counter[str]) -> list[str]:
    """Every present patch with its details; a distribution that is not installed is one line, not one per patch."""
    d, margins, stored = report.data, report.margins or {}, report.stored or {}
    present = [e for e in d["patches"] if e["state"] != State.NOT_INSTALLED.value]
    lines: list[str] = []
    pad = max((len(e["id"]) for e in present), default=0)
    for e in present:
        lines.append(f"{e['id']:<{pad}}  {_shown(e, stored)[0]}")
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
