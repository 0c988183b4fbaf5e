"""Asserting that kvpatch's fixes are in effect (docs/servers.md): :func:`require` / :func:`is_fixed` for the fixes
a server names, :func:`require_applied` for every applicable patch."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

from . import _copy_records, get_engine
from .config import Config
from .detect import Upstream
from .engine import Engine, PatchStatus
from .gate import Action, Decision, decide
from .record import DISTRIBUTIONS, Patch
from .registry import Stub, module_for
from .states import MEANINGS, Check, Reason, State


def _gate(engine: Engine, patch: Patch | Stub, config: Config | None = None) -> Decision:
    """By default "applicable": the off switches ignored, the opt-ins kept; a gate that raises reads APPLY (so
    the failure the engine recorded shows)."""
    upstream = engine.upstream.get(patch.distribution) or Upstream(patch.distribution, None)
    applicable = Config(enabled_ids=engine.config.enabled_ids, enable_all=engine.config.enable_all)
    try:
        return decide(patch, upstream, config or applicable)
    except Exception:
        return Decision(Action.VERIFY if config else Action.APPLY, "the gate raised")


def problems(engine: Engine, *, imported: Iterable[str] | None = None) -> tuple[list[PatchStatus], list[Guarantee]]:
    """(applicable statuses, problems): an applicable patch (or copy's) not in, unless pending with none of its
    modules ``imported``; a verify-decided patch that failed, drifted, was overridden, is inconclusive, or
    is unverified with a module imported; a broken unit."""
    loaded = set(sys.modules if imported is None else imported)
    engine.refresh()  # "applied" means reachable now
    applicable: list[PatchStatus] = []
    found: list[Guarantee] = []
    for patch in engine.materialise():
        st = engine.status[patch.id]
        action, meaning = _gate(engine, st.patch).action, MEANINGS[st.state]
        waiting = meaning.waits and not any(m in loaded for m in patch.modules)  # settled at an import to come
        if action is Action.APPLY:
            applicable.append(st)
            bad = not meaning.fixed and not waiting
        else:  # one its reproduction decides: only what --check calls a problem
            bad = action is Action.VERIFY and meaning.check is not Check.CLEAN and not waiting
        if bad:
            found.append(Guarantee(patch.id, False, st.state.value, st.error or st.reason))
    for st in _copy_records():
        if st.decision.action is Action.APPLY:
            applicable.append(st)
            if not MEANINGS[st.state].fixed and (st.state is not State.PENDING or st.copy in loaded):
                found.append(Guarantee(f"{st.record.id} in {st.copy}", False, st.state.value, st.error or st.reason))
    found.extend(Guarantee(module, False, "broken", error) for module, error in engine.broken.items())
    return applicable, found


def require_applied(*, import_targets: bool = True) -> list[PatchStatus]:
    """Raise :class:`NotApplied` unless every patch that applies to the installed upstream is installed (failed,
    drifted, disabled or pending all count); return their statuses. ``import_targets`` imports their target modules
    first; without it, pending patches whose modules are not imported yet are not counted."""
    engine = get_engine()
    if import_targets:
        # their hooks get the chance to install them; one whose module fails to import stays pending, and counts
        engine.activation.import_pending(
            st.patch for st in engine.status.values() if _gate(engine, st.patch).action is Action.APPLY
        )
    applicable, found = problems(engine)
    if found:
        raise NotApplied(found)
    return applicable


@dataclass(frozen=True)
class Guarantee:
    """Whether one fix is in effect in this process, with the state and reason ``status`` shows for it."""

    patch_id: str
    fixed: bool
    state: str
    reason: str

    def __str__(self) -> str:
        return f"{self.patch_id}: {'ok' if self.fixed else 'NOT FIXED'}: {self.state}: {self.reason}"


class NotFixed(RuntimeError):
    """A fix named to :func:`require` is neither in effect nor needless with the installed upstream."""

    def __init__(self, guarantees: list[Guarantee], headline: str = "") -> None:
        self.guarantees = guarantees
        self.problems = [g for g in guarantees if not g.fixed]
        headline = headline or f"{len(self.problems)} required fix(es) not in effect"
        super().__init__(f"kvpatch: {headline}:" + "".join(f"\n  - {g}" for g in guarantees))


class NotApplied(NotFixed):
    """An applicable patch is not installed in this process."""

    def __init__(self, found: list[Guarantee]) -> None:
        super().__init__(found, "applicable patches are not applied")


class UnknownPatch(LookupError):
    """A patch id that kvpatch does not know (a typo, or a patch this kvpatch release does not have)."""

    def __init__(self, patch_id: str, known: Iterable[str]) -> None:
        import difflib  # here: kvpatch loads this module with itself, and a typo is rare

        self.patch_id = patch_id
        self.suggestions = difflib.get_close_matches(patch_id, sorted(known), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(map(repr, self.suggestions))}?" if self.suggestions else ""
        super().__init__(f"kvpatch knows no patch {patch_id!r}{hint} (`python -m kvpatch status` lists them)")


def _patch_status(engine: Engine, patch_id: str) -> PatchStatus | Guarantee:
    """The patch's status, or the guarantee already known for a patch unit that could not be loaded."""
    if patch_id in engine.status:
        return engine.status[patch_id]
    for name, error in engine.broken.items():
        if name in (module_for(patch_id, dist) for dist in DISTRIBUTIONS):
            return Guarantee(patch_id, False, "broken", f"its patch unit could not be loaded: {error}")
    raise UnknownPatch(patch_id, engine.status)


def _guarantee(engine: Engine, st: PatchStatus) -> Guarantee:
    patch, state, reason = st.patch, st.state, st.error or st.reason
    if st.suspended:
        return Guarantee(patch.id, False, "suspended", str(Reason("suspended")))
    if MEANINGS[state].fixed:
        return Guarantee(patch.id, True, state.value, reason)
    if state in (State.DISABLED, State.OPT_IN):
        # off: fixed only where the installed upstream has no such bug (the gate with the patch opted in)
        upstream = _gate(engine, patch, Config(enabled_ids=frozenset({patch.id})))
        if upstream.action in (Action.NOT_NEEDED, Action.OUT_OF_RANGE, Action.NOT_INSTALLED):
            return Guarantee(
                patch.id, True, state.value, str(Reason("off-not-needed", reason=reason, gate=upstream.reason))
            )
        if state is State.DISABLED:
            reason = str(Reason("off-not-ruled-out", reason=reason, gate=upstream.reason))
    if state is State.PENDING:
        missing = ", ".join(m for m in st.record.modules if m not in sys.modules)
        why = Reason("not-imported", modules=missing) if missing else Reason("not-installed", reason=reason)
        reason = str(why if engine.active else Reason("not-active"))
    return Guarantee(patch.id, False, state.value, reason)


def guarantees(engine: Engine, patch_ids: Iterable[str]) -> list[Guarantee]:
    """One :class:`Guarantee` per id, in order; an unknown id raises :class:`UnknownPatch` before any import (an id
    that is not a str: :class:`TypeError`)."""
    patch_ids = list(patch_ids)
    if bad := [pid for pid in patch_ids if not isinstance(pid, str)]:
        raise TypeError(f"a patch id is a str, not {type(bad[0]).__name__} ({bad[0]!r})")
    statuses = [_patch_status(engine, pid) for pid in patch_ids]
    engine.activation.import_pending(st.patch for st in statuses if isinstance(st, PatchStatus))
    engine.refresh()  # "applied" means reached now
    return [_guarantee(engine, st) if isinstance(st, PatchStatus) else st for st in statuses]


def require(*patch_ids: str) -> list[Guarantee]:
    """Raise :class:`NotFixed` unless every named fix is in effect in this process; return the guarantees.

    A fix is in effect when its patch is applied and reached now, or when the installed upstream does not have the
    bug (a patch that is off counts only then). Pending patches' target modules are imported first: call this after
    your own patches are in. An unknown id raises :class:`UnknownPatch` (with close matches)."""
    if not patch_ids:
        raise TypeError("kvpatch.require() needs at least one patch id")
    found = guarantees(get_engine(), patch_ids)
    if any(not g.fixed for g in found):
        raise NotFixed(found)
    return found


def is_fixed(patch_id: str) -> bool:
    """Whether one fix is in effect (:func:`require`'s test); never raises but :class:`UnknownPatch` (a typo must
    not read as "not fixed") and :class:`TypeError` (an id that is not a str)."""
    if not isinstance(patch_id, str):
        raise TypeError(f"is_fixed() takes a patch id (str), not {type(patch_id).__name__}")
    try:
        return guarantees(get_engine(), (patch_id,))[0].fixed
    except UnknownPatch:
        raise
    except Exception:  # a broken engine: nothing can be counted on
        return False
