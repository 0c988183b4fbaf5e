"""Asserting that kvpatch is active: for servers at start-up and for downstream test sessions.

``kvpatch.require_applied()`` imports the target modules of every patch the gate says applies to the
installed upstream (so that their hooks install them), then raises :class:`NotApplied` when any such
patch is not installed: failed, drifted, disabled (``KVPATCH=off``, ``KVPATCH_DISABLE``), or still
pending. It returns the status of every applicable patch (possibly empty: nothing to fix here)::

    import kvpatch

    kvpatch.require_applied()   # at server start-up, after importing mlx_lm / mlx_vlm

The gate's decision is taken with the environment's off switches ignored (the *natural* decision), so
a patch turned off by ``KVPATCH_DISABLE`` still counts as applicable and makes the assertion fail. An
opt-in patch counts only where it was opted in (``KVPATCH_ENABLE``): then it is applicable like any
other, and a server that replaced it without calling it fails the assertion.

A server that relies on some fixes only names them: :func:`require` passes when each named fix is in
effect (applied and reached now, or not needed because the installed upstream does not have the bug)
and raises :class:`NotFixed` otherwise; :func:`is_fixed` answers the same question for one fix without
raising, to gate a server's own code::

    kvpatch.require("batch-logits-processors", "qsdpa-gqa-batch-mask")   # at start-up
    if not kvpatch.is_fixed("offset-detach"):
        ...                                                              # keep the server's own guard
"""

from __future__ import annotations

import contextlib
import difflib
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from .config import Config
from .detect import Upstream
from .engine import Engine, PatchStatus, State
from .gate import Action, Decision, decide
from .record import Patch

__all__ = [
    "Guarantee",
    "NotApplied",
    "NotFixed",
    "Problem",
    "UnknownPatch",
    "guarantees",
    "is_fixed",
    "problems",
    "require",
    "require_applied",
]


@dataclass(frozen=True)
class Problem:
    patch_id: str
    state: str
    reason: str

    def __str__(self) -> str:
        return f"{self.patch_id}: {self.state}: {self.reason}"


class NotApplied(RuntimeError):
    """An applicable patch is not installed in this process."""

    def __init__(self, found: list[Problem]) -> None:
        self.problems = found
        super().__init__("kvpatch: applicable patches are not applied:\n" + "\n".join(f"  - {p}" for p in found))


def _natural(engine: Engine, st: PatchStatus) -> Action:
    upstream = engine.upstream.get(st.patch.distribution) or Upstream(st.patch.distribution, None)
    opted = engine.config.enabled_ids
    config = Config(enabled_ids=opted, enable_all=engine.config.enable_all)
    try:
        return decide(st.patch, upstream, config).action
    except Exception:
        return Action.APPLY  # a gate that raises on this record: the engine failed it, report that


def problems(engine: Engine, *, imported: Iterable[str] | None = None) -> tuple[list[PatchStatus], list[Problem]]:
    """(applicable statuses, problems) for ``engine``'s patches.

    Applicable: the natural decision is APPLY. A problem: an applicable patch that is failed, drifted,
    disabled, or pending although one of its target modules is imported (``imported``, default
    ``sys.modules``); or a VERIFY patch that failed, drifted, was overridden or inconclusive, or is still
    pending verification with a target module imported; or a patch module that could not be loaded.
    """
    loaded = set(sys.modules if imported is None else imported)
    engine.refresh()  # "applied" means reachable now, not installed once
    applicable: list[PatchStatus] = []
    found: list[Problem] = []
    for patch in engine.materialise():
        st = engine.status[patch.id]
        action = _natural(engine, st)
        if action is Action.APPLY:
            applicable.append(st)
            if st.state in (State.APPLIED, State.NOT_NEEDED):
                continue  # (not needed under an APPLY decision: its builders declined this backend)
            if st.state is State.PENDING and not any(m in loaded for m in patch.modules):
                continue  # its modules were never imported: nothing to patch yet
            found.append(Problem(patch.id, st.state.value, st.error or st.reason))
        elif action is Action.VERIFY and (
            st.state in (State.FAILED, State.DRIFTED, State.TARGET_MISSING, State.OVERRIDDEN, State.INCONCLUSIVE)
            or (st.state is State.UNVERIFIED and any(m in loaded for m in patch.modules))
        ):
            # pending verification with its modules imported: the fix may be needed and is not in
            # (``kvpatch verify`` settles it); inconclusive: nobody knows whether it is needed
            found.append(Problem(patch.id, st.state.value, st.error or st.reason))
    vendored = sys.modules.get("kvpatch.vendored")  # copies a server registered (kvpatch.register_copy)
    for st in vendored.copy_records() if vendored is not None else ():
        if st.decision.action is Action.APPLY:
            applicable.append(st)
            pending = st.state is State.PENDING and st.copy not in loaded
            if st.state not in (State.APPLIED, State.NOT_NEEDED) and not pending:
                found.append(Problem(f"{st.record.id} in {st.copy}", st.state.value, st.error or st.reason))
    for module, error in engine.broken.items():
        found.append(Problem(module, "broken", error))
    return applicable, found


def require_applied(*, import_targets: bool = True) -> list[PatchStatus]:
    """Raise :class:`NotApplied` unless every applicable patch is installed; return their statuses.

    With ``import_targets`` (default) the target modules of applicable patches are imported first,
    so a pending patch gets its chance to install; without it, pending patches whose modules are not
    imported yet are not counted as problems.
    """
    from . import get_engine

    engine = get_engine()
    if import_targets:
        for st in engine.status.values():
            if _natural(engine, st) is Action.APPLY and st.state is State.PENDING:
                for module in st.record.modules:
                    with contextlib.suppress(ImportError):
                        __import__(module)
    applicable, found = problems(engine)
    if found:
        raise NotApplied(found)
    return applicable


# -- per-fix guarantees ----------------------------------------------------------------------------
#: States in which the bug cannot bite this process: the fix is reached now, or upstream has no such bug.
_FIXED_STATES = frozenset({State.APPLIED, State.NOT_NEEDED, State.OUT_OF_RANGE, State.NOT_INSTALLED})
#: Gate actions that say the installed upstream does not have the bug (or is not installed at all).
_UPSTREAM_FINE = frozenset({Action.NOT_NEEDED, Action.OUT_OF_RANGE, Action.NOT_INSTALLED})


@dataclass(frozen=True)
class Guarantee:
    """Whether one fix is in effect in this process, with the state and reason ``status`` shows for it."""

    patch_id: str
    fixed: bool
    state: str
    reason: str

    def __str__(self) -> str:
        mark = "ok" if self.fixed else "NOT FIXED"
        return f"{self.patch_id}: {mark}: {self.state}: {self.reason}"


class NotFixed(RuntimeError):
    """A fix named to :func:`require` is neither in effect nor needless with the installed upstream."""

    def __init__(self, guarantees: list[Guarantee]) -> None:
        self.guarantees = guarantees
        self.problems = [g for g in guarantees if not g.fixed]
        lines = "\n".join(f"  - {g}" for g in guarantees)
        super().__init__(f"kvpatch: {len(self.problems)} required fix(es) not in effect:\n{lines}")


class UnknownPatch(LookupError):
    """A patch id that kvpatch does not know (a typo, or a patch this kvpatch release does not have)."""

    def __init__(self, patch_id: str, known: Iterable[str]) -> None:
        self.patch_id = patch_id
        self.suggestions = difflib.get_close_matches(patch_id, sorted(known), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(map(repr, self.suggestions))}?" if self.suggestions else ""
        super().__init__(f"kvpatch knows no patch {patch_id!r}{hint} (`python -m kvpatch status` lists them)")

    def __str__(self) -> str:  # LookupError's str() would quote the whole message
        return str(self.args[0])


def _patch_status(engine: Engine, patch_id: str) -> PatchStatus | Guarantee:
    """The patch's status, or the guarantee already known for a patch unit that could not be loaded."""
    st = engine.status.get(patch_id)
    if st is not None:
        return st
    module = patch_id.replace("-", "_")
    for name, error in engine.broken.items():
        folder, _, leaf = name.rpartition(".")  # the unit's file name drops its folder's lm/vlm (CONTRIBUTING.md)
        short = folder.rpartition(".")[2].removeprefix("mlx_")
        if module in (leaf, f"{short}_{leaf}", f"{leaf}_{short}"):
            return Guarantee(patch_id, False, "broken", f"its patch unit could not be loaded: {error}")
    raise UnknownPatch(patch_id, engine.status)


def _upstream_decision(engine: Engine, patch: Patch) -> Decision:
    """The gate's decision for ``patch`` with every off switch ignored and the patch opted in."""
    upstream = engine.upstream.get(patch.distribution) or Upstream(patch.distribution, None)
    try:
        return decide(patch, upstream, Config(enabled_ids=frozenset({patch.id})))
    except Exception:
        return Decision(Action.VERIFY, "the gate raised")  # settles nothing


def _guarantee(engine: Engine, st: PatchStatus) -> Guarantee:
    patch, state = engine.record_of(st), st.state
    reason = st.error or st.reason
    if st.suspended:
        return Guarantee(patch.id, False, "suspended", "taken out in this process (suspend / kvpatch.testing.without)")
    if state in _FIXED_STATES:
        return Guarantee(patch.id, True, state.value, reason)
    if state in (State.DISABLED, State.OPT_IN):
        upstream = _upstream_decision(engine, patch)
        if upstream.action in _UPSTREAM_FINE:
            # switched off, but the installed upstream has no such bug: nothing to fix
            return Guarantee(patch.id, True, state.value, f"{reason}; not needed: {upstream.reason}")
        if state is State.DISABLED:
            reason = f"{reason}; without it the bug is not ruled out: {upstream.reason}"
    if state is State.PENDING:
        reason = f"its target modules ({', '.join(patch.modules)}) could not be imported, so it is not installed"
    return Guarantee(patch.id, False, state.value, reason)


def guarantees(engine: Engine, patch_ids: Iterable[str]) -> list[Guarantee]:
    """One :class:`Guarantee` per id, in order, for ``engine`` (what :func:`require` checks).

    Target modules of pending patches are imported first (their hooks install them), and every installed
    replacement is looked up again, so "applied" means reached now. An unknown id raises
    :class:`UnknownPatch` before anything is imported.
    """
    statuses = [_patch_status(engine, pid) for pid in patch_ids]
    for st in statuses:
        if isinstance(st, PatchStatus) and st.state is State.PENDING:  # give its hooks their chance
            for module in engine.record_of(st).modules:
                with contextlib.suppress(ImportError):
                    __import__(module)
    engine.refresh()
    return [_guarantee(engine, st) if isinstance(st, PatchStatus) else st for st in statuses]


def require(*patch_ids: str) -> list[Guarantee]:
    """Raise :class:`NotFixed` unless every named fix is in effect in this process; return the guarantees.

    A fix is in effect when its patch is applied and reached now (not overridden, suspended or disabled),
    or when the installed upstream does not have the bug (the gate's decision: out of range, not needed,
    the distribution is not installed, or this environment's verdict found the bug absent). A patch that
    is off (``KVPATCH=off``, ``KVPATCH_DISABLE``, an opt-in not enabled) counts only where upstream does
    not need it. Target modules of pending patches are imported first, so call this after your own
    patches are in. An id kvpatch does not know raises :class:`UnknownPatch` (with close matches).
    """
    if not patch_ids:
        raise TypeError("kvpatch.require() needs at least one patch id")
    from . import get_engine

    found = guarantees(get_engine(), patch_ids)
    if any(not g.fixed for g in found):
        raise NotFixed(found)
    return found


def is_fixed(patch_id: str) -> bool:
    """Whether one fix is in effect in this process (the test :func:`require` makes); never raises for a
    known id (an unknown one raises :class:`UnknownPatch`: a typo must not read as "not fixed")."""
    from . import get_engine

    try:
        (guarantee,) = guarantees(get_engine(), (patch_id,))
    except UnknownPatch:
        raise
    except Exception:  # a broken engine: nothing can be counted on
        return False
    return guarantee.fixed
