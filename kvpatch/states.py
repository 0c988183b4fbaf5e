"""A patch's states and what each means, in one table (:data:`MEANINGS`): what it gives ``status --check``, where and
under which title the compact ``status`` view shows it, whether the bug can bite (``require``), and the sentence
docs/status.md says (a test holds that page and every state to this table). Why a patch is in its state, and why a
check needs attention, is a :class:`Reason`: a code and its facts, worded here only (:data:`WORDING`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from .gate import Action

__all__ = ["Check", "Meaning", "Outcome", "Reason", "State"]


class State(enum.Enum):
    PENDING = "pending"  # decided to apply; the target module has not been imported yet
    APPLIED = "applied"
    NOT_NEEDED = "not needed"
    OUT_OF_RANGE = "out of range"
    NOT_INSTALLED = "not installed"
    DISABLED = "disabled"
    OPT_IN = "opt-in"  # changes documented upstream behaviour; off unless KVPATCH_ENABLE names it
    DRIFTED = "drifted"  # target code is not what the patch was validated on, and the reproduction did not settle it
    FAILED = "failed"
    TARGET_MISSING = "target missing"  # a target is not where the patch expects it (moved or removed upstream)
    OVERRIDDEN = "overridden"  # installed, but something else replaced kvpatch's replacement since
    UNVERIFIED = "pending verification"  # the reproduction decides and no verdict exists yet: not applied
    INCONCLUSIVE = "inconclusive"  # the verdict's reproduction hit an error that is not the bug: not applied


class Outcome(str, enum.Enum):
    """What runs without and with a patch say (:func:`kvpatch.verdicts.judge`; the stored ones are verdicts)."""

    FIXED = "bug present, fixed by patch"
    ABSENT = "bug absent upstream"
    NOT_FIXED = "bug present, NOT fixed by patch"
    INCONCLUSIVE = "inconclusive"
    SKIPPED = "skipped"
    ELSEWHERE = "bug absent in this process, fixed by something else in this process"
    UNPATCHED = "bug present, patch not applied"
    COULD_NOT_RUN = "could not run"


class Check(enum.IntEnum):
    """What a state or a finding gives ``status --check``: its exit status."""

    CLEAN = 0
    ATTENTION = 1
    FAILURE = 2


@dataclass(frozen=True)
class Meaning:
    rank: int  # the compact view's order, attention first; ranks up to EXPLAINED give each patch's reason
    title: str  # the compact view's group title
    meaning: str  # what docs/status.md says
    check: Check = Check.CLEAN  # what the state gives --check
    line: str = ""  # the check line's wording (:data:`WORDING`), where the state needs attention
    unpatched: Check = Check.CLEAN  # --check, where --verify finds the bug present and the patch not applied
    fixed: bool = False  # the bug cannot bite this process (require, is_fixed)
    #: needs no attention and grows with the catalogue: the compact view counts it in the summary line only, unless
    #: the patch needs attention (an overdue review, a --verify finding)
    quiet: bool = False
    waits: bool = False  # settled by an import still to come: no problem while none of its modules is imported


EXPLAINED = 4
_1, _2 = Check.ATTENTION, Check.FAILURE
# fmt: off
MEANINGS: dict[State, Meaning] = {
    State.FAILED: Meaning(0, "FAILED: not applied, the bug is live", check=_2, line="check-failing",
                          meaning="an error while applying: recorded, warned once, never raised into your program"),
    State.TARGET_MISSING: Meaning(1, "TARGET MISSING: upstream moved or removed what the patch replaces", check=_2,
                                  line="check-failing",
                                  meaning="a target is not where the patch expects it: moved or removed upstream"),
    State.DRIFTED: Meaning(2, "DRIFTED: the target's code is not what the patch was validated on", check=_1,
                           line="check-state", meaning="the target's code is not what the patch was validated on, "
                           "and the reproduction did not confirm the fix"),
    State.INCONCLUSIVE: Meaning(3, "INCONCLUSIVE: the reproduction could not tell", check=_1,
                                line="check-inconclusive", meaning="the verdict is inconclusive: not applied"),
    State.NOT_NEEDED: Meaning(4, "not needed", fixed=True, quiet=True, unpatched=_1,
                              meaning="the installed release or pinned commit carries upstream's fix, or the "
                              "reproduction found no bug"),
    State.OUT_OF_RANGE: Meaning(4, "out of range", fixed=True, quiet=True, unpatched=_1,
                                meaning="the release predates the bug"),
    State.NOT_INSTALLED: Meaning(4, "not installed", fixed=True, quiet=True,
                                 meaning="the patched distribution is not installed"),
    State.UNVERIFIED: Meaning(5, "pending verification: the reproduction decides", check=_1, line="check-unverified",
                              unpatched=_1, waits=True, meaning="the reproduction decides and this environment has no "
                              "verdict yet: not applied ([verdicts](verdicts.md))"),
    State.OVERRIDDEN: Meaning(6, "overridden", check=_1, line="check-state",
                              meaning="installed, but something else has since replaced kvpatch's replacement "
                              "without calling it: the reason names it"),
    State.OPT_IN: Meaning(7, "opt-in available: off unless KVPATCH_ENABLE names it",
                          meaning="changes documented upstream behaviour: off unless `KVPATCH_ENABLE` names it"),
    State.DISABLED: Meaning(8, "disabled", meaning="left out by `KVPATCH=off` or `KVPATCH_DISABLE`: your choice, so "
                            "`--check` stays clean, also where `--verify` finds the bug"),
    State.APPLIED: Meaning(9, "applied", fixed=True, quiet=True,
                           meaning="the replacement is reachable now (also after a reload)"),
    State.PENDING: Meaning(10, "will apply when its module is imported", waits=True, quiet=True,
                           meaning="with `--no-settle`: will apply when the target module is imported"),
}
#: A pending patch its stored verdict settles, shown with the verdict's outcome until its module is imported.
AWAITING = Meaning(EXPLAINED, "pending ({outcome})", waits=True, quiet=True,
                   meaning="with `--no-settle`: its stored verdict settles it when the target module is imported")
#: What ``status --verify`` finds beyond what the patch's state says: --check for each outcome that needs attention.
VERIFY_CHECKS = {Outcome.NOT_FIXED: _2, Outcome.COULD_NOT_RUN: _1, Outcome.INCONCLUSIVE: _1}
#: The gate's action -> the state a patch starts in.
OF_ACTION = {Action.APPLY: State.PENDING, Action.VERIFY: State.PENDING, Action.NOT_NEEDED: State.NOT_NEEDED,
             Action.OUT_OF_RANGE: State.OUT_OF_RANGE, Action.NOT_INSTALLED: State.NOT_INSTALLED,
             Action.DISABLED: State.DISABLED, Action.OPT_IN: State.OPT_IN}
#: A verdict's outcome -> the state it settles a patch in (FIXED: installed, as its targets arrive) and the wording.
OF_VERDICT = {Outcome.FIXED: (State.PENDING, "verdict"), Outcome.ABSENT: (State.NOT_NEEDED, "verdict"),
              Outcome.NOT_FIXED: (State.DRIFTED, "verdict-not-applied"),
              Outcome.INCONCLUSIVE: (State.INCONCLUSIVE, "verdict-inconclusive"),
              Outcome.SKIPPED: (State.NOT_NEEDED, "verdict-skipped")}
#: The wording of each ``--verify`` outcome that says its detail (ELSEWHERE: whose code was in place); the others say
#: the outcome alone (:func:`found`).
_FOUND = {Outcome.SKIPPED: "found-error", Outcome.COULD_NOT_RUN: "found-error", Outcome.ELSEWHERE: "found-detail",
          Outcome.UNPATCHED: "found-detail"}
# fmt: on

#: Every reason's wording, by code: the one place a state's reason or a check line becomes text.
WORDING = {
    # why a patch is in its state
    "gate-raised": "the gate raised",
    "failed": "{state}: {error}",
    "no-activation": "{error}",
    "foreign": "{why}: kvpatch's fix was validated on {distribution}'s code and a verdict measures that code, not "
    "this replacement: not applied",
    "no-verdict": "{why}; {request}",
    "verdict": "{why}; verdict: {verdict}",
    "verdict-not-applied": "{why}; verdict: {verdict}: not applied",
    "verdict-inconclusive": "{why}; the reproduction was inconclusive here ({detail}): not applied",
    "verdict-skipped": "{why}; the reproduction cannot run on this backend ({detail}): not applied",
    "declined": "{decision}; nothing to change here: the patch declined this backend (see its record)",
    "in-place": "{decision}; its replacement is in place already",
    "overridden": "{by}",
    "copy": "copy of {distribution} {version}'s {of}: {decision}",
    "copy-verdict": "{copy}; the installed release's verdict: {verdict}",
    "copy-unverified": "{copy}; the reproduction runs on upstream, not on a copy: not applied",
    "copy-refused": "{patch} cannot patch {module}: {why}",
    "copy-not-applied": "{copy}; not applied: {why}",
    "copy-declined": "{copy}; nothing to change in the copy (the builders declined)",
    # what a check needs attention for
    "check-failing": "{id}: {reason}",
    "check-state": "{id}: {state}: {reason}",
    "check-inconclusive": "{id}: inconclusive here, not applied (not a record error): {error}",
    "check-unverified": "{id}: pending verification (no verdict for this environment): run `kvpatch verify`",
    "check-drift": "{id}: applied to drifted code (reproduction confirmed); validate and record it",
    "check-broken": "{module}: could not be loaded: {error}",
    "check-overdue": "{id}: review-by date {review_by} has passed ({condition}): run `python -m kvpatch "
    "upstream-check`, then retire the patch or set a new Expiry(review_by=...)",
    "check-problem": "{problem}",
    # what --verify found, and what that asks for
    "found": "{outcome}",
    "found-detail": "{outcome} ({detail})",
    "found-inconclusive": "{outcome} {detail}",
    "found-inconclusive-with": "{outcome} with the patch: {detail}",
    "found-error": "{outcome}: {detail}",  # the outcome's own words say "skipped" and "could not run"
    "verify-" + Outcome.NOT_FIXED.name: "{id}: {found}",
    "verify-" + Outcome.COULD_NOT_RUN.name: "{id}: verify {found} (this environment needs attention; not a record "
    "error)",
    "verify-" + Outcome.INCONCLUSIVE.name: "{id}: verify {found} (an error that is not the bug: this environment "
    "needs attention)",
    "verify-record": "{id}: {found}: the record says otherwise; update its {field}",
    "verify-unverified": "{id}: {found}: no verdict in this process; run `python -m kvpatch verify`",
    "verify-absent": "{id}: applied, but the bug is absent upstream: update the record's {field}",
    # what require() and is_fixed() say
    "suspended": "taken out in this process (suspend / kvpatch.testing.without)",
    "off-not-needed": "{reason}; not needed: {gate}",
    "off-not-ruled-out": "{reason}; without it the bug is not ruled out: {gate}",
    "not-active": "kvpatch is not active in this process (kvpatch.deactivate()): not installed",
    "not-imported": "its target modules ({modules}) could not be imported, so it is not installed",
    "not-installed": "its target modules are imported but it is not installed: {reason}",
}


@dataclass(init=False, repr=False)
class Reason:
    """Why: a code of :data:`WORDING` and the facts its wording names (a fact may be a reason itself)."""

    code: str
    facts: dict[str, Any]

    def __init__(self, code: str, **facts: Any) -> None:
        self.code, self.facts = code, facts

    def __str__(self) -> str:
        return WORDING[self.code].format(**self.facts)

    def __repr__(self) -> str:
        return f"Reason({self.code!r}, {self.facts!r})"


def found(outcome: Outcome, detail: str = "", *, state: State | None = None, tried: str | None = None) -> Reason:
    """What ``--verify`` found, as its report says it: ``state`` the patch's (an unpatched bug names it), ``tried``
    what the run with the patch hit (an inconclusive finding says it)."""
    if outcome is Outcome.INCONCLUSIVE:
        code = "found-inconclusive-with" if tried else "found-inconclusive"
        return Reason(code, outcome=outcome.value, detail=tried or detail)
    if outcome is Outcome.UNPATCHED and state is not None:  # the patch's state says why it is not applied
        detail = state.value
    return Reason(_FOUND.get(outcome, "found"), outcome=outcome.value, detail=detail)


def verify_check(pid: str, outcome: Outcome, said: Reason, state: State, field_: str) -> tuple[Check, Reason | None]:
    """What a ``--verify`` finding gives ``--check`` for a patch in ``state``, beyond what the state gives, and why
    (``field_``: the record field a finding about upstream's code contradicts, :func:`kvpatch.gate.misplaced`)."""
    if outcome in VERIFY_CHECKS:
        return VERIFY_CHECKS[outcome], Reason("verify-" + outcome.name, id=pid, found=said)
    if outcome is Outcome.UNPATCHED and MEANINGS[state].unpatched:
        code = "verify-unverified" if state is State.UNVERIFIED else "verify-record"
        return MEANINGS[state].unpatched, Reason(code, id=pid, found=said, field=field_)
    if outcome is Outcome.ABSENT and state is State.APPLIED:
        return Check.ATTENTION, Reason("verify-absent", id=pid, field=field_)
    return Check.CLEAN, None
