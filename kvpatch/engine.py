"""The lifecycle of kvpatch in one process: decide once (the gate), hook each target module, install there what a
version fact or the verdict stored for this environment decides, put the originals back on request. The
:class:`Engine` coordinates (every state change under its lock), its :class:`Activation` is the post-import hooks
(which never measure: a :class:`kvpatch.verifier.Verifier` does, outside every import), its :class:`Installer` the
changes on upstream's objects (:func:`kvpatch.surgery.install`, the one install path).

The lock guards the engine's bookkeeping only: it is never held while importing, building a replacement (builders
may import), registering hooks or warning. Nothing in a hook raises: errors become the patch's state and a warning."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from . import fingerprints, registry, surgery, verdicts
from ._site import BrokenInstall, hooks
from ._warn import KvpatchWarning, emit, failure
from .config import Config, read_config
from .detect import Upstream, detect
from .gate import Action, Decision, decide
from .record import DISTRIBUTIONS, Bug, Finding, Kind, Patch, Target
from .registry import Stub
from .states import OF_ACTION, OF_VERDICT, Outcome, Reason, State
from .surgery import MISSING, Change, TargetMissing
from .verifier import request_verification

__all__ = ["Engine", "KvpatchWarning", "PatchStatus", "State"]


@dataclass
class PatchStatus:
    """What happened to one patch in this process."""

    patch: Patch | Stub
    decision: Decision
    state: State
    why: Reason | None = None  # why it is in its state (None: its decision's reason; ``reason`` says it in words)
    error: str | None = None
    drift: list[str] = field(default_factory=list)  # how the target code differs from what the patch was validated on
    verified: str | None = None  # the verdict this process read or measured
    installed: list[Target] = field(default_factory=list)
    suspended: bool = False
    fingerprinted: set[Target] = field(default_factory=set)  # targets whose fingerprint was checked already
    notes: list[str] = field(default_factory=list)  # what restore had to leave in place, newest last
    wrapped: list[str] = field(default_factory=list)  # targets reached only through someone else's wrapper
    foreign: list[str] = field(default_factory=list)  # targets holding another library's replacement
    copy: str | None = None  # the vendored copy's module (:func:`kvpatch.register_copy`); None: upstream's
    measurement: Measurement | None = None  # the runs without and with the patch, when this process measured
    #: The key of the verdict that decides the patch here, once its reproduction was found to decide it.
    verdict_key: str | None = None
    #: Per target, (original given, builder's result) until installed: deciding it declines does not build twice.
    built: dict[Target, tuple[Any, Any]] = field(default_factory=dict, repr=False)

    @property
    def reason(self) -> str:
        return self.decision.reason if self.why is None else str(self.why)

    def note(self, text: str) -> None:
        """Note ``text`` (what restore had to leave in place, or why the state stays as it is) once."""
        if text not in self.notes:
            self.notes.append(text)

    @property
    def record(self) -> Patch:
        """``patch`` as its record (the engine resolves a stub before it installs, verifies or restores it)."""
        if not isinstance(self.patch, Patch):
            raise TypeError(f"{self.patch!r} is not resolved")
        return self.patch


@dataclass(frozen=True)
class Measurement:  # the runs of Engine.measure
    before: Finding
    after: Finding | None = None  # None: not tried (the bug was absent without it, or it is not installed)
    foreign: tuple[str, ...] = ()  # targets holding another library's code during the run without the patch


class Engine:
    """Installs a set of patches into this process (the process's one: :func:`kvpatch.get_engine`)."""

    def __init__(
        self,
        patches: Iterable[Patch | Stub],
        *,
        upstream: dict[str, Upstream] | None = None,
        config: Config | None = None,
        broken: dict[str, str] | None = None,
    ) -> None:
        #: Install order; a :class:`~kvpatch.registry.Stub` is a unit its gate settled without importing it.
        self.patches: list[Patch | Stub] = sorted(patches, key=lambda p: (p.order, p.id))
        self.upstream = upstream if upstream is not None else detect()
        self.config = config if config is not None else read_config(known_ids=frozenset(p.id for p in self.patches))
        self.broken = dict(broken or {})
        self.status: dict[str, PatchStatus] = {}
        self.lock = threading.RLock()
        self.installer = Installer(self)
        self.activation = Activation(self)
        self.active = False  # hooks registered by an inactive engine do nothing
        _ENGINES.add(self)
        for problem in self.config.problems:
            emit(problem, key=f"config:{problem}")
        self._decide_all()
        for module, error in self.broken.items():
            emit(f"patch module {module} could not be loaded: {error}", key=f"broken:{module}")

    def _decide_all(self) -> None:
        for patch in self.patches:
            self.status[patch.id] = self._decide(patch)
        pending = [p for p in self.patches if isinstance(p, Stub) and self.status[p.id].state is State.PENDING]
        for record in self._resolve(pending):
            self.status[record.id] = self._decide(record)

    def _decide(self, patch: Patch | Stub) -> PatchStatus:
        upstream = self.upstream.get(patch.distribution) or Upstream(patch.distribution, None)
        try:
            decision = decide(patch, upstream, self.config)
        except Exception as exc:  # a broken record must not break imports
            failed = Decision(Action.DISABLED, "gate raised")
            return PatchStatus(patch, failed, State.FAILED, Reason("gate-raised"), error=failure(exc))
        return PatchStatus(patch, decision, OF_ACTION[decision.action])

    def reconsider(self, config: Config) -> None:
        """Restore everything and decide every patch again under ``config`` (``kvpatch verify``)."""
        self.deactivate()
        self.config = config
        self._decide_all()

    def materialise(self) -> list[Patch]:
        """Every patch as its record, in install order (importing the units)."""
        self._resolve([p for p in list(self.patches) if isinstance(p, Stub)])
        with self.lock:
            return [p for p in self.patches if isinstance(p, Patch)]

    def _resolve(self, stubs: list[Stub]) -> list[Patch]:
        """The records of ``stubs`` (their units imported outside the lock); one that fails goes to ``broken``, unless
        its file is gone (kvpatch was uninstalled or replaced since) and the gate settled it without its unit."""
        results, kept = registry.resolve(stubs), 0
        with self.lock:
            for stub in [s for s in stubs if s in self.patches]:
                st, result = self.status[stub.id], results[stub.id]
                if isinstance(result, Patch):
                    self.patches[self.patches.index(stub)] = st.patch = result
                elif result.gone and st.state is not State.PENDING:  # that still holds: kept, its record not shown
                    said = f"can no longer be loaded ({result.error}): state as decided then"
                    st.note(f"its patch module {stub.module} {said}")
                    kept += 1
                else:
                    self.patches.remove(stub)
                    self.status.pop(stub.id, None)
                    self.broken[stub.module] = result.error
        if kept:
            emit(
                f"kvpatch's patch modules can no longer be loaded (kvpatch was uninstalled or replaced while this "
                f"process runs): {kept} patch(es) keep the state decided when it started here",
                key="units-gone",
            )
        return [r for r in results.values() if isinstance(r, Patch)]

    def activate(self) -> None:
        self.activation.on()

    def deactivate(self) -> None:
        """Restore every original still kvpatch's; the hooks stay registered and do nothing until re-activated."""
        with self.lock:
            self.active = False
            statuses = [st for st in self.status.values() if st.installed]
        for st in statuses:
            self.installer.uninstall(st)
            with self.lock:
                if st.state in (State.APPLIED, State.OVERRIDDEN):
                    self.set_state(st, State.PENDING, None)
        with self.lock:
            orphans, self.installer.orphans = self.installer.orphans, []
        for change in reversed(orphans):
            surgery.restore(change)

    def measure(self, patch: Patch, *, install: bool = True, device: str | None = None) -> Measurement:
        """kvpatch's one "with and without" of ``patch``'s reproduction. *Without*: every installed patch on one of its
        targets taken out (it can hide the symptom) except enablers (needed to run at all). *With*: as the engine has
        it; not installed, installed for that run when ``install`` is on and the bug was present without it.
        ``device``: where both run (:func:`run_reproduction`; ``None``: where a verdict is)."""
        import_target_modules(patch)
        st = self.status[patch.id]
        with self.without(*sharing(self, patch)):
            foreign = tuple(surgery.foreign_targets(patch))
            before = run_reproduction(patch, device)
        if st.installed or not (install and before.bug is Bug.PRESENT):
            return Measurement(before, run_reproduction(patch, device) if st.installed else None, foreign)
        self.installer.install(st)
        try:
            return Measurement(before, run_reproduction(patch, device), foreign)
        finally:
            self.installer.uninstall(st)

    def set_state(self, st: PatchStatus, state: State, why: Any = MISSING, *, error: Any = MISSING) -> None:
        """The one place a patch's state changes, under the engine's lock: ``why`` a :class:`~kvpatch.states.Reason`,
        None for its decision's reason; ``why`` or ``error`` unset: kept."""
        with self.lock:
            st.state = state
            if why is not MISSING:
                st.why = why
            if error is not MISSING:
                st.error = error

    def refresh(self) -> None:
        self.installer.refresh()

    @contextmanager
    def without(self, *patch_ids: str) -> Iterator[None]:
        """Run a block with the named patches removed: outermost first, back innermost first (a stack is kept)."""
        ids = [pid for pid in patch_ids if self.status[pid].installed or self.status[pid].state is State.APPLIED]
        with self.lock:
            order = list(dict.fromkeys(c.patch_id for c in self.installer.changes))
        ids.sort(key=lambda pid: order.index(pid) if pid in order else len(order))
        for pid in reversed(ids):
            self.suspend(pid)
        try:
            yield
        finally:
            for pid in ids:
                self.resume(pid)

    def suspend(self, patch_id: str) -> None:
        st = self.status[patch_id]
        st.suspended = True
        self.installer.uninstall(st)

    def resume(self, patch_id: str) -> None:
        st = self.status[patch_id]
        st.suspended = False
        if st.state in (State.APPLIED, State.OVERRIDDEN):
            self.installer.install(st)

    def changes(self) -> list[tuple[str, str]]:
        with self.lock:
            return [(c.patch_id, c.target.path) for c in self.installer.changes]


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

    def import_pending(
        self, patches: Iterable[Patch | Stub], failed: Callable[[str, str, Exception], object] = lambda *_: None
    ) -> None:
        """Import the target modules of each of ``patches`` still pending when its turn comes (one patch's import
        settles others); a module that fails to import goes to ``failed(patch id, module, exception)``."""
        for patch in patches:
            if (st := self.engine.status[patch.id]).state is State.PENDING:  # resolved (Engine._decide_all)
                import_target_modules(st.record, partial(failed, patch.id))

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
            emit(f"kvpatch: {st.patch.id}: {st.reason}", key=f"drift:{st.patch.id}")
            return
        st.verdict_key = verdicts.key(st.record, engine.upstream)
        found = verdicts.lookup(st.verdict_key)
        if found is None:  # no measuring here: a verification process settles it
            request = request_verification([st.verdict_key])
            engine.set_state(st, State.UNVERIFIED, Reason("no-verdict", why=why, request=request))
        else:
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
        with suppress(Exception):  # restoring failed too: the first error is the one to report
            engine.installer.uninstall(st)
        state = State.TARGET_MISSING if isinstance(exc, TargetMissing) else State.FAILED
        error = failure(exc)
        engine.set_state(st, state, Reason("failed", state=state.value, error=error), error=error)
        emit(f"kvpatch: patch {st.patch.id} is not applied ({state.value}): {error}", key=f"fail:{st.patch.id}")

    def import_failed(self, patch_id: str, module: str, exc: BaseException) -> None:
        error = f"importing {module} failed: {failure(exc)}"
        why = Reason("failed", state=State.FAILED.value, error=error)
        self.engine.set_state(self.engine.status[patch_id], State.FAILED, why, error=error)


class Installer:
    """One engine's changes, in install order (its lock is the engine's)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.changes: list[Change] = []
        self.orphans: list[Change] = []  # changes on objects a reloaded module no longer holds
        #: (id(owner), name) -> the foreign wrapt proxy a restore spliced the original in under (fixes go back there)
        self.spliced: dict[tuple[int, str], Any] = {}
        self.local = threading.local()  # per thread: modules whose post-import hook runs now

    def hooking(self) -> set[str]:
        hooking: set[str] = self.local.__dict__.setdefault("hooking", set())
        return hooking

    def install(self, st: PatchStatus) -> None:
        """Install each target of ``st`` whose module is imported, all or nothing (not needed: builders decline)."""
        for target in st.record.targets:
            module = sys.modules.get(target.module)
            # a circular import still executing the module: its own hook will come
            if target in st.installed or module is None or (target.module not in self.hooking() and executing(module)):
                continue
            try:
                self._install(st, target, module)
            except Exception:
                self.uninstall(st)
                raise
        with self.engine.lock:
            if st.installed and st.state is not State.APPLIED:
                self.engine.set_state(st, State.APPLIED, MISSING if st.verified else None)
        if not st.installed:
            self.declined(st)

    def declined(self, st: PatchStatus) -> bool:
        """True (and the patch settled as not needed) when every builder whose target is imported declines."""
        seen = False
        for target in st.record.targets:
            module = sys.modules.get(target.module)
            if target.kind is not Kind.REPLACE:
                return False
            original = upstream_original(self.changes, target, module) if module is not None else MISSING
            if original is MISSING or module is None:
                if target.optional:
                    continue  # may never exist in this release; imported later, its own hook decides again
                return False
            if self.build(st, target, surgery.owner_of(target, module), original) is not original:
                return False
            seen = True
        if seen:
            self.engine.set_state(st, State.NOT_NEEDED, Reason("declined", decision=st.decision.reason))
        return seen

    @staticmethod
    def build(st: PatchStatus, target: Target, owner: Any, original: Any) -> Any:
        """The builder's result for ``original`` (:func:`kvpatch.surgery.build`), built once per original."""
        built = st.built.get(target)
        if built is not None and built[0] is original:
            return built[1]
        function = surgery.build(st.record, owner, original, st.record.builders[target])
        st.built[target] = (original, function)
        return function

    def _install(self, st: PatchStatus, target: Target, module: types.ModuleType) -> None:
        """Install one target; one reaching the replacement already (re-exported, or wrapped) is adopted."""
        patch, lock = st.record, self.engine.lock
        owner = surgery.owner_of(target, module)
        present = inspect.getattr_static(owner, target.attribute, MISSING)
        if present is not MISSING and surgery.carries(present, patch.id):
            with lock:
                st.note(f"{target.path}: already carries kvpatch's {patch.id}")
                if st.state is State.PENDING:
                    self.engine.set_state(st, State.APPLIED, Reason("in-place", decision=st.decision.reason))
            return
        key = (id(owner), target.attribute)
        with lock:  # a restore spliced the original in under a foreign proxy: the fix goes back under it
            proxy = self.spliced.get(key)
            if proxy is not None and present is not proxy:  # the proxy changed or went: installed afresh
                del self.spliced[key]
                proxy = None

        def record(change: Change) -> None:
            st.built.pop(target, None)  # a build is installed once: another install builds afresh
            self.changes.append(change)
            st.installed.append(target)

        make = partial(self.build, st, target, owner)
        change = surgery.install(patch, target, owner, make=make, lock=lock, record=record, under=proxy)
        if change is not None and proxy is None and isinstance(owner, types.ModuleType) and change.original is not None:
            # late activation: any module may hold the original by name; at a fresh import only upstream's can
            everywhere = target.module not in self.hooking()
            surgery.rebind_aliases(change.original, change.function, skip=owner, everywhere=everywhere)

    def uninstall(self, st: PatchStatus) -> None:
        """Remove one patch's changes, keeping patches stacked above it on the same attributes."""
        engine = self.engine
        with engine.lock:
            mine = [c for c in self.changes if c.patch_id == st.patch.id]
            st.installed.clear()
            if not mine:
                return
            keys = {(id(c.owner), c.name) for c in mine}
            later = self.changes[self.changes.index(mine[0]) :]
            undo = [c for c in reversed(later) if (id(c.owner), c.name) in keys]  # this patch's and those above it
            self._drop(undo)
        for change in undo:
            note = surgery.restore(change)
            with engine.lock:
                if change.spliced_into is not None:
                    self.spliced[(id(change.owner), change.name)] = change.spliced_into
                if note:
                    engine.status[change.patch_id].notes.append(note)
            if note:
                emit(f"kvpatch: {note}", key=f"restore:{change.target.path}:{note}")
        for pid in dict.fromkeys(c.patch_id for c in undo):  # their restore hooks: a failure is noted, warned once
            for hook in engine.status[pid].record.restore_hooks:
                try:
                    hook()
                except Exception as exc:  # never raised
                    note = f"restore hook {getattr(hook, '__qualname__', hook)} raised: {failure(exc)}"
                    with engine.lock:
                        engine.status[pid].note(note)
                    emit(f"kvpatch: {pid}: {note}", key=f"restore-hook:{pid}")
        for change in reversed(undo):  # reinstall what was stacked above, on top of the restored original
            module = sys.modules.get(change.target.module)
            if change.patch_id != st.patch.id and module is not None:
                self._install(engine.status[change.patch_id], change.target, module)

    def _drop(self, changes: list[Change]) -> None:
        for change in changes:
            self.changes.remove(change)
            installed = self.engine.status[change.patch_id].installed
            if change.target in installed:
                installed.remove(change.target)

    def refresh(self) -> None:
        """Re-read every installed replacement; a reloaded target module (no hook fires) is patched again first."""
        engine = self.engine
        with engine.lock:
            stale = [c for c in self.changes if _reexecuted(c)]
            self._drop(stale)
            self.orphans.extend(stale)
        for pid in dict.fromkeys(c.patch_id for c in stale):
            if engine.status[pid].state in (State.APPLIED, State.OVERRIDDEN):
                engine.activation.advance(engine.status[pid])
        with engine.lock:
            changes = list(self.changes)
        for pid in dict.fromkeys(c.patch_id for c in changes):
            reached(engine, engine.status[pid], [c for c in changes if c.patch_id == pid])


def upstream_original(changes: list[Change], target: Target, module: types.ModuleType) -> Any:
    """The upstream object at ``target``, looking through the replacements in ``changes`` (``MISSING``: none)."""
    owner = surgery.owner_of(target, module)
    if owner is MISSING:
        return MISSING
    first = next((c for c in changes if c.owner is owner and c.name == target.attribute), None)
    if first is not None and first.raw_original is not MISSING:
        return getattr(first.raw_original, "__func__", first.raw_original)
    static = inspect.getattr_static(owner, target.attribute, MISSING)
    # only kvpatch's own objects (an attribute a patch added): no upstream code to compare
    return next((o for o in surgery.reachable(static, closures=False) if surgery.mark_of(o) is None), MISSING)


def reached(engine: Engine, st: PatchStatus, changes: list[Change]) -> None:
    """Re-read ``st``'s installed replacements outside the lock, set under it: "applied" means reachable now."""
    results = [surgery.liveness(change) for change in changes]
    with engine.lock:
        gone = [detail for state, detail in results if state in ("overridden", "removed")]
        st.wrapped = [detail for state, detail in results if state == "wrapped"]
        if gone and st.state is State.APPLIED:
            engine.set_state(st, State.OVERRIDDEN, Reason("overridden", by="; ".join(gone)))
        elif not gone and st.state is State.OVERRIDDEN:
            engine.set_state(st, State.APPLIED, None)


def _reexecuted(change: Change) -> bool:
    """True when ``change``'s module was executed again (``importlib.reload``): a new owner or module function."""
    module = sys.modules.get(change.target.module)
    if module is None or executing(module):
        return False
    owner = surgery.owner_of(change.target, module)
    if owner is not change.owner:
        return owner is not MISSING
    current = vars(owner).get(change.name, MISSING)
    return (
        not change.target.owner_path
        and type(current) is types.FunctionType
        and current is not change.original
        and current.__globals__ is vars(owner)
        and surgery.mark_of(current) is None
    )


def executing(module: types.ModuleType | None) -> bool:
    """True while ``module``'s own code is still running (importlib marks its spec)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def sharing(engine: Engine, patch: Patch) -> list[str]:
    """The installed patches on one of ``patch``'s targets, itself too but not the enablers: what its run without it
    takes out."""
    mine = {(t.module, t.qualname) for t in patch.targets}
    return [
        st.record.id
        for st in (engine.status[p.id] for p in engine.patches)
        if st.installed
        and (st.record is patch or not st.record.enabler)
        and mine & {(t.module, t.qualname) for t in st.record.targets}
    ]


def import_target_modules(patch: Patch, failed: Callable[[str, Exception], object] | None = None) -> None:
    """Import the patch's target modules; one holding only optional targets may fail (some raise without Metal)."""
    for module in patch.modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            if all(t.optional for t in patch.targets if t.module == module):
                continue
            if failed is None:
                raise
            failed(module, exc)


#: Ids of the reproductions run in this process, in order: tests read it to prove a user's import ran none.
REPRODUCTIONS_RUN: list[str] = []


def run_reproduction(patch: Patch, device: str | None = None) -> Finding:
    """Run ``patch``'s reproduction keeping mlx's default device and stream, and its random state where mlx allows it
    (up to 0.31; newer mlx's cannot be set back, one reason reproductions never run in a user's process). It runs on
    the CPU unless its bug lives in a device's kernels (``Patch.on_device``, ``Patch.metal_only``; then on the GPU
    where there is one): a logic bug's verdict is then the same on every machine, whatever the GPU's arithmetic
    (TF32). ``device``: ``"cpu"`` or ``"default"`` (mlx's default device) instead of that rule, for measurements
    (``scripts/margins.py``)."""
    if patch.reproduction is None:
        raise LookupError(f"{patch.id} has no reproduction")
    REPRODUCTIONS_RUN.append(patch.id)
    mx: Any = sys.modules.get("mlx.core") or importlib.import_module("mlx.core")
    state: Any = getattr(mx.random, "state", None)
    saved = list(state) if isinstance(state, list) else None
    default = mx.default_device()
    stream = mx.default_stream(default)
    if device == "default":
        where = default
    elif device is None and (patch.on_device or patch.metal_only):
        where = mx.gpu if mx.is_available(mx.gpu) else default
    else:
        where = mx.cpu
    try:
        with mx.stream(where):
            finding = patch.reproduction()
    except Exception as exc:
        return Finding.from_error(exc)
    finally:
        if saved is not None:
            state[:] = saved
        mx.set_default_device(default)
        mx.set_default_stream(stream)
    if not isinstance(finding, Finding):
        raise TypeError(f"{patch.id}: reproduction returned {finding!r}, not a Finding")
    return finding


#: Every engine of this process, for :func:`_after_fork`.
_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def _after_fork() -> None:
    """In a child of ``os.fork`` only the forking thread lives on: a lock another thread held, and that thread's
    bookkeeping, would stay forever. Each engine gets a fresh lock and per-thread state (as ``logging`` does)."""
    for engine in list(_ENGINES):
        engine.lock = threading.RLock()
        engine.installer.local = threading.local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def hook_registry() -> Any:
    """``register_post_import_hook(hook, name)`` of kvpatch's bootstrap: it never imports inside the import lock."""
    registry = hooks()
    if registry is None:
        raise BrokenInstall("kvpatch's post-import hooks (_kvpatch_hooks) cannot be loaded: reinstall kvpatch")
    return registry.register_post_import_hook
