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
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from .config import Config
from .detect import Upstream
from .engine import Engine, PatchStatus, State
from .gate import Action, decide

__all__ = ["NotApplied", "Problem", "problems", "require_applied"]


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
