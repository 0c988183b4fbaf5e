"""Activation: kvpatch's post-import hooks on the target modules, and what a hook does when its module arrives: it
installs what is decided there, by a version fact or by the verdict stored for this environment. A hook never
measures (a verification process's :class:`kvpatch.verifier.Verifier` does, outside every import) and never raises:
an error becomes the patch's state and a warning."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

from . import fingerprints, verdicts
from ._site import BrokenInstall, hooks
from ._warn import emit, failure
from .gate import Action
from .installer import executing, upstream_original
from .record import DISTRIBUTIONS, Patch
from .states import OF_VERDICT, Outcome, PatchStatus, Reason, State
from .surgery import MISSING, TargetMissing
from .verifier import import_target_modules, request_verification

if TYPE_CHECKING:
    from .engine import Engine


class Activation:
    """One engine's hooks: the modules hooked, and the upstream packages fully imported."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.hooked: set[str] = set()
        self.ready: set[str] = set()  # top-level upstream packages fully imported

    def on(self) -> None:
        """Hook the target modules of every patch that may apply; those imported already are advanced now."""
        engine = self.engine
        with engine.lock:
            if engine.active:
                return
            engine.active = True
            live = [st for st in engine.status.values() if st.state in (State.PENDING, State.APPLIED)]
            names = dict.fromkeys(n for st in live for n in (st.patch.import_name, *st.record.modules))
            fresh = [n for n in names if n not in self.hooked]
            self.hooked.update(fresh)
        # Outside the lock: the registry may call the hook at once, and the hook takes the lock itself.
        for loaded in filter(None, (sys.modules.get(n) for n in names if n not in fresh)):  # not called again
            self.hook(loaded)
        if not fresh:
            return
        try:
            register = hook_registry()
        except Exception as exc:  # no hook will ever fire: nothing pending can apply
            error = f"kvpatch could not activate: {failure(exc)}"
            with engine.lock:
                engine.active = False
                self.hooked.clear()
                for st in [st for st in engine.status.values() if st.state is State.PENDING]:
                    engine.set_state(st, State.FAILED, Reason("no-activation", error=error), error=error)
            emit(error, key="activate")
            return
        for name in fresh:
            register(self.hook, name)

    def import_pending(self, patches: Iterable[Patch], failed: Callable[[str, str, Exception], None]) -> None:
        """Import the target modules of each of ``patches`` still pending when its turn comes (one patch's import
        settles others); a module that fails to import goes to ``failed(patch id, module, exception)``."""
        for patch in patches:
            if self.engine.status[patch.id].state is State.PENDING:
                import_target_modules(patch, partial(failed, patch.id))

    def hook(self, module: types.ModuleType) -> None:
        """Runs inside the user's import statement: never raises, never measures."""
        engine = self.engine
        try:
            if not engine.active:
                return
            name, hooking = module.__name__, engine.installer.hooking()
            top = name in DISTRIBUTIONS.values()
            if top:
                self.ready.add(name)
            hooking.add(name)
            try:
                for st in [engine.status[p.id] for p in engine.patches]:
                    live = st.state is State.PENDING or (not top and st.state is State.APPLIED)
                    if live and (st.patch.import_name == name if top else name in st.record.modules):
                        self.advance(st)
            finally:
                hooking.discard(name)
        except Exception as exc:  # pragma: no cover - advance catches its own errors
            emit(f"kvpatch hook for {getattr(module, '__name__', module)} failed: {exc}", key="hook-crash")

    def advance(self, st: PatchStatus) -> None:
        """Install what is decided for ``st`` now that a target module is here; a patch its reproduction decides (by
        its record, or its target code drifted) waits until its package is fully imported, then reads its verdict."""
        engine = self.engine
        if st.suspended:
            return
        try:
            if not st.verified:
                fingerprints.check_drift(st, partial(upstream_original, engine.installer.changes))
                if st.decision.action is Action.VERIFY or st.drift:
                    package = sys.modules.get(st.patch.import_name)
                    if st.patch.import_name not in self.ready and (package is None or executing(package)):
                        return  # builders import freely: wait until the package is fully imported
                    if st.installed:
                        engine.installer.uninstall(st)  # a newly arrived target drifted: judge the whole patch
                    return self._by_verdict(st)
            engine.installer.install(st)
        except Exception as exc:
            self.fail(st, exc)

    def _by_verdict(self, st: PatchStatus) -> None:
        """Settle ``st`` by this environment's stored verdict; none: not applied, and a verification is requested."""
        engine = self.engine
        if engine.installer.declined(st):
            return  # nothing would change here (e.g. a CUDA-only fix on the CPU): no verdict needed
        why = "; ".join(st.drift) or st.decision.reason
        if st.foreign:
            engine.set_state(st, State.DRIFTED, Reason("foreign", why=why, distribution=st.patch.distribution))
            return emit(f"kvpatch: {st.patch.id}: {st.reason}", key=f"drift:{st.patch.id}")
        st.verdict_key = verdicts.key(st.record, engine.upstream)
        found = verdicts.lookup(st.verdict_key)
        if found is None:
            request = request_verification([st.verdict_key])
            return engine.set_state(st, State.UNVERIFIED, Reason("no-verdict", why=why, request=request))
        self.settle(st, found)

    def settle(self, st: PatchStatus, verdict: verdicts.Verdict) -> None:
        """Settle ``st`` by ``verdict`` (read, or measured by a :class:`~kvpatch.verifier.Verifier`): installed where
        it says the patch fixes the bug, else left out in the state :data:`kvpatch.states.OF_VERDICT` gives."""
        engine = self.engine
        st.verified, patch_id = verdict.describe(), st.patch.id
        outcome = Outcome.NOT_FIXED if verdict.outcome is Outcome.SKIPPED and st.drift else verdict.outcome
        state, code = OF_VERDICT.get(outcome, OF_VERDICT[Outcome.NOT_FIXED])
        why = "; ".join(st.drift) or st.decision.reason
        if state is not State.PENDING and st.installed:
            engine.installer.uninstall(st)
        error = verdict.detail if state is State.INCONCLUSIVE else MISSING
        engine.set_state(st, state, Reason(code, why=why, verdict=st.verified, detail=verdict.detail), error=error)
        if state is State.PENDING:  # installed now, or by hooks later
            engine.installer.install(st)
            if st.drift:
                said = f"applied to drifted code after its reproduction confirmed it: {why}"
                emit(f"kvpatch: {patch_id} {said}", key=f"drift:{patch_id}")
        elif state is State.INCONCLUSIVE:
            emit(f"kvpatch: {patch_id} not applied: {st.reason}", key=f"verdict:{patch_id}")
        elif state is State.DRIFTED:
            emit(f"kvpatch: {patch_id}: {st.reason}", key=f"drift:{patch_id}")

    def fail(self, st: PatchStatus, exc: BaseException) -> None:
        """``st`` not applied because of ``exc`` (a target missing, or a failure): restored, warned about once."""
        engine = self.engine
        try:
            engine.installer.uninstall(st)
        except Exception:  # restoring failed too: the first error is the one to report
            pass
        state, error = State.TARGET_MISSING if isinstance(exc, TargetMissing) else State.FAILED, failure(exc)
        engine.set_state(st, state, Reason("failed", state=state.value, error=error), error=error)
        emit(f"kvpatch: patch {st.patch.id} is not applied ({state.value}): {error}", key=f"fail:{st.patch.id}")

    def import_failed(self, patch_id: str, module: str, exc: BaseException) -> None:
        engine = self.engine
        error = f"importing {module} failed: {failure(exc)}"
        why = Reason("failed", state=State.FAILED.value, error=error)
        engine.set_state(engine.status[patch_id], State.FAILED, why, error=error)


def hook_registry() -> Any:
    """``register_post_import_hook(hook, name)`` of kvpatch's bootstrap: it never imports inside the import lock."""
    registry = hooks()
    if registry is None:
        raise BrokenInstall("kvpatch's post-import hooks (_kvpatch_hooks) cannot be loaded: reinstall kvpatch")
    return registry.register_post_import_hook
