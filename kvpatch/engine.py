"""The lifecycle of kvpatch in one process: decide once (the gate), hook each target module, install the patches
that apply when it arrives, and put the originals back on request (the mechanics: :mod:`kvpatch.surgery`).

The engine's lock guards its bookkeeping only: it is never held while importing, building a replacement (builders
may import), registering hooks or warning. Nothing in a hook raises: errors become the patch's state and a warning.
"""

from __future__ import annotations

import enum
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

from . import fingerprints, measurer, surgery, verdicts
from ._site import BrokenInstall, hooks
from ._warn import KvpatchWarning, emit, failure
from .config import Config, read_config
from .detect import Upstream, detect
from .gate import Action, Decision, decide
from .record import DISTRIBUTIONS, Bug, Finding, Kind, Patch, Target
from .registry import Stub
from .surgery import MISSING as _MISSING
from .surgery import Change, TargetMissing
from .verdicts import Outcome

__all__ = ["Engine", "KvpatchWarning", "PatchStatus", "State"]


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


FROM_ACTION = {a: State.PENDING if a in (Action.APPLY, Action.VERIFY) else State(a.value) for a in Action}


@dataclass(frozen=True)
class Measurement:
    """The runs of :meth:`Engine.measure`."""

    before: Finding
    after: Finding | None = None  # None: not tried (the bug was absent without it, or it is not installed)
    foreign: tuple[str, ...] = ()  # targets holding another library's code during the run without the patch

    def outcome(self, applied: bool = True) -> tuple[Outcome, str]:
        """:func:`kvpatch.verdicts.judge` of the runs (``applied`` false: without the run with the patch)."""
        return verdicts.judge(self.before, self.after if applied else None, self.foreign)


@dataclass
class PatchStatus:
    """What happened to one patch in this process."""

    patch: Patch | Stub
    decision: Decision
    state: State
    reason: str
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
    #: Per target, (original given, builder's result) until installed: deciding it declines does not build twice.
    built: dict[Target, tuple[Any, Any]] = field(default_factory=dict, repr=False)

    @property
    def record(self) -> Patch:
        """``patch`` as its record (the engine resolves a stub before it installs, verifies or restores it)."""
        if not isinstance(self.patch, Patch):
            raise TypeError(f"{self.patch!r} is not resolved")
        return self.patch


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
        self._changes: list[Change] = []  # in install order
        self._orphans: list[Change] = []  # changes on objects a reloaded module no longer holds
        #: (id(owner), name) -> the foreign wrapt proxy a restore spliced the original in under (fixes go back there)
        self._spliced: dict[tuple[int, str], Any] = {}
        self._hooked: set[str] = set()
        self._ready: set[str] = set()  # top-level upstream packages fully imported
        self._local = threading.local()  # per thread: modules whose post-import hook runs now
        self._lock = threading.RLock()
        _ENGINES.add(self)
        self.active = False  # hooks registered by an inactive engine do nothing
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
        try:
            upstream = self.upstream.get(patch.distribution) or Upstream(patch.distribution, None)
            decision = decide(patch, upstream, self.config)
        except Exception as exc:  # a broken record must not break imports
            decision = Decision(Action.DISABLED, "gate raised")
            return PatchStatus(patch, decision, State.FAILED, "the gate raised", error=failure(exc))
        return PatchStatus(patch, decision, FROM_ACTION[decision.action], decision.reason)

    def reconsider(self, config: Config) -> None:
        """Restore everything and decide every patch again under ``config`` (``kvpatch verify``)."""
        self.deactivate()
        self.config = config
        self._decide_all()

    def materialise(self) -> list[Patch]:
        """Every patch as its record, in install order (importing the units)."""
        with self._lock:
            stubs = [p for p in self.patches if isinstance(p, Stub)]
        self._resolve(stubs)
        with self._lock:
            return [p for p in self.patches if isinstance(p, Patch)]

    def _resolve(self, stubs: list[Stub]) -> list[Patch]:
        """Import the units of ``stubs`` outside the lock (a unit's code runs); one that fails goes to ``broken``."""
        results: dict[str, Patch | str] = {}
        gone: list[Stub] = []
        for stub in stubs:
            try:
                results[stub.id] = stub.resolve()
            except Exception as exc:
                results[stub.id] = failure(exc)
                missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
                if missing and f"{stub.module}.".startswith(f"{missing}."):
                    gone.append(stub)  # its file is gone: kvpatch was uninstalled or replaced since this process began
        kept = 0
        with self._lock:
            for stub, result in ((s, results[s.id]) for s in stubs if s in self.patches):
                st = self.status[stub.id]
                if isinstance(result, Patch):
                    self.patches[self.patches.index(stub)] = st.patch = result
                elif stub in gone and st.state is not State.PENDING:
                    # the gate settled it without its unit, and that still holds: kept, its record not shown
                    note = f"its patch module {stub.module} can no longer be loaded ({result}): state as decided then"
                    if note not in st.notes:
                        st.notes.append(note)
                    kept += 1
                else:
                    self.patches.remove(stub)
                    self.status.pop(stub.id, None)
                    self.broken[stub.module] = result
        if kept:
            emit(
                f"kvpatch's patch modules can no longer be loaded (kvpatch was uninstalled or replaced while this "
                f"process runs): {kept} patch(es) keep the state decided when it started here",
                key="units-gone",
            )
        return [r for r in results.values() if isinstance(r, Patch)]

    @staticmethod
    def record_of(st: PatchStatus) -> Patch:
        return st.patch if isinstance(st.patch, Patch) else st.patch.resolve()

    def import_failed(self, patch_id: str, module: str, exc: BaseException) -> None:
        error = f"importing {module} failed: {failure(exc)}"
        with self._lock:
            set_state(self.status[patch_id], State.FAILED, f"failed: {error}", error=error)

    def activate(self) -> None:
        with self._lock:
            if self.active:
                return
            self.active = True
            live = [st for st in self.status.values() if st.state in (State.PENDING, State.APPLIED)]
            names = dict.fromkeys(n for st in live for n in (st.patch.import_name, *st.record.modules))
            fresh = [n for n in names if n not in self._hooked]
            self._hooked.update(fresh)
        # Outside the lock: the registry may call the hook at once, and the hook takes the lock itself.
        for loaded in filter(None, (sys.modules.get(n) for n in names if n not in fresh)):  # not called again
            self._hook(loaded)
        if not fresh:
            return
        try:
            register = hook_registry()
        except Exception as exc:  # no hook will ever fire: nothing pending can apply
            error = f"kvpatch could not activate: {failure(exc)}"
            with self._lock:
                self.active = False
                self._hooked.clear()
                for st in self.status.values():
                    if st.state is State.PENDING:
                        set_state(st, State.FAILED, error, error=error)
            emit(error, key="activate")
            return
        for name in fresh:
            register(self._hook, name)

    def deactivate(self) -> None:
        """Restore every original still kvpatch's; the hooks stay registered and do nothing until re-activated."""
        with self._lock:
            self.active = False
            statuses = [st for st in self.status.values() if st.installed]
            orphans, self._orphans = self._orphans, []
        for st in statuses:
            self._uninstall(st)
            with self._lock:
                if st.state in (State.APPLIED, State.OVERRIDDEN):
                    set_state(st, State.PENDING, st.decision.reason)
        for change in reversed(orphans):
            surgery.restore(change)

    def _hooking(self) -> set[str]:
        hooking: set[str] = self._local.__dict__.setdefault("hooking", set())
        return hooking

    def _hook(self, module: types.ModuleType) -> None:
        """Runs inside the user's import statement: never raises."""
        try:
            if not self.active:
                return
            name = module.__name__
            top = name in DISTRIBUTIONS.values()
            if top:
                self._ready.add(name)
            hooking = self._hooking()
            hooking.add(name)
            try:
                for st in [self.status[p.id] for p in self.patches]:
                    live = st.state is State.PENDING or (not top and st.state is State.APPLIED)
                    if live and (st.patch.import_name == name if top else name in st.record.modules):
                        self._advance(st)
            finally:
                hooking.discard(name)
        except Exception as exc:  # pragma: no cover - _advance catches its own errors
            emit(f"kvpatch hook for {getattr(module, '__name__', module)} failed: {exc}", key="hook-crash")

    def _advance(self, st: PatchStatus) -> None:
        if st.suspended:
            return
        try:
            if not st.verified:
                self._check_drift(st)
                if st.decision.action is Action.VERIFY or st.drift:
                    package = sys.modules.get(st.patch.import_name)
                    if st.patch.import_name not in self._ready and (package is None or executing(package)):
                        return  # reproductions import freely: wait until the package is fully imported
                    if st.installed:
                        self._uninstall(st)  # a newly arrived target drifted: judge the whole patch
                    self._verify_and_apply(st)
                    return
            self._install_available(st)
        except TargetMissing as exc:
            self._fail(st, exc, State.TARGET_MISSING)
        except Exception as exc:
            self._fail(st, exc)

    def _check_drift(self, st: PatchStatus) -> None:
        """A replaced target whose fingerprint is none recorded for the affected releases: the verdict decides."""
        patch = st.record
        known = fingerprints.validated(patch) if st.decision.action is not Action.VERIFY else None
        if not known:
            return
        for target in patch.targets:
            recorded = known.get(target.path)
            module = sys.modules.get(target.module)
            if target.kind is not Kind.REPLACE or target in st.fingerprinted or not recorded or module is None:
                continue
            original = self.upstream_original(target, module)
            if original is _MISSING:
                continue
            st.fingerprinted.add(target)
            fp = fingerprints.cached(original)
            if fp in recorded:
                continue
            top = target.module.split(".", 1)[0]
            # only a plain function is another library's code here: a proxy is looked through by the fingerprint
            where = surgery.foreign(original, top) if type(original) is types.FunctionType else None
            if where is None:
                st.drift.append(
                    f"{target.path} has source fingerprint {fp}, none of the {len(recorded)} recorded for "
                    f"{patch.distribution} releases in {patch.affected}"
                )
                continue
            inner = surgery.upstream_inner(original, top)
            if inner is not None and fingerprints.cached(inner) in recorded:
                continue  # another library's wrapper around upstream code kvpatch validated
            # a replacement not reaching upstream's code: no verdict (measured on upstream's code) vouches for it
            st.foreign.append(target.path)
            st.drift.append(
                f"{target.path} is {where}, another library's replacement of {patch.distribution}'s "
                "code (installed before kvpatch and not calling upstream's)"
            )
        fingerprints.save(wait=measurer.measuring() is not None)

    def _verify_and_apply(self, st: PatchStatus) -> None:
        """Settle a patch by this environment's verdict: a verification process measures, a user's process reads."""
        patch = st.record
        why = "; ".join(st.drift) or st.decision.reason
        if self._declined(st):
            return  # nothing would change here (e.g. a CUDA-only fix on the CPU): no verdict needed
        if st.foreign:
            validated = f"kvpatch's fix was validated on {patch.distribution}'s code and a verdict measures that code"
            set_state(st, State.DRIFTED, f"{why}: {validated}, not this replacement: not applied")
            emit(f"kvpatch: {patch.id}: {st.reason}", key=f"drift:{patch.id}")
            return
        verdict_key = verdicts.key(patch, self.upstream)
        found = None if measurer.remeasure() else verdicts.lookup(verdict_key)
        by = measurer.measuring()
        if found is None and by is not None:
            with measurer.measuring_patch(patch.id) as first:
                if not first:
                    return  # a hook fired by this very measurement (importing the targets): the outer call decides
                st.measurement = self.measure(patch, install=True)
            found = verdicts.verdict_of(st.measurement.before, st.measurement.after, by=by)
            verdicts.store(verdict_key, patch, found, self.upstream)
        if found is None:
            set_state(st, State.UNVERIFIED, f"{why}; {measurer.request_verification([verdict_key])}")
            return
        st.verified = found.describe()
        outcome = Outcome.NOT_FIXED if found.outcome is Outcome.SKIPPED and st.drift else found.outcome
        if outcome is Outcome.FIXED:
            set_state(st, State.PENDING, f"{why}; verdict: {st.verified}")  # installed now, or by hooks later
            self._install_available(st)
            if st.drift:
                note = f"kvpatch: {patch.id} applied to drifted code after its reproduction confirmed it: {why}"
                emit(note, key=f"drift:{patch.id}")
            return
        state, tail = {
            Outcome.ABSENT: (State.NOT_NEEDED, f"verdict: {st.verified}"),
            Outcome.INCONCLUSIVE: (State.INCONCLUSIVE, f"the reproduction was inconclusive here ({found.detail})"),
            Outcome.SKIPPED: (State.NOT_NEEDED, f"the reproduction cannot run on this backend ({found.detail})"),
        }.get(outcome, (State.DRIFTED, f"verdict: {st.verified}"))
        tail += "" if outcome is Outcome.ABSENT else ": not applied"
        set_state(st, state, f"{why}; {tail}", error=found.detail if state is State.INCONCLUSIVE else _MISSING)
        if state is State.INCONCLUSIVE:
            emit(f"kvpatch: {patch.id} not applied: {st.reason}", key=f"verdict:{patch.id}")
        elif state is State.DRIFTED:
            emit(f"kvpatch: {patch.id}: {st.reason}", key=f"drift:{patch.id}")

    def measure(self, patch: Patch, *, install: bool = True, device: str | None = None) -> Measurement:
        """kvpatch's one "with and without" of ``patch``'s reproduction. *Without*: every installed patch on one of its
        targets taken out (it can hide the symptom) except enablers (needed to run at all). *With*: as this process
        has it; not installed, installed for that run when ``install`` is on and the bug was present without it.
        ``device``: where both run (:func:`run_reproduction`; ``None``: where a verdict is measured)."""
        import_target_modules(patch)
        st = self.status[patch.id]
        with self.without(*self._sharing(patch)):
            foreign = tuple(surgery.foreign_targets(patch))
            before = run_reproduction(patch, device)
        after = None
        if st.installed:
            after = run_reproduction(patch, device)
        elif install and before.bug is Bug.PRESENT:
            self._install_available(st)
            try:
                after = run_reproduction(patch, device)
            finally:
                self._uninstall(st)
        return Measurement(before, after, foreign)

    def _sharing(self, patch: Patch) -> list[str]:
        mine = {(t.module, t.qualname) for t in patch.targets}
        return [
            st.record.id
            for st in (self.status[p.id] for p in self.patches)
            if st.installed
            and (st.record is patch or not st.record.enabler)
            and mine & {(t.module, t.qualname) for t in st.record.targets}
        ]

    def _install_available(self, st: PatchStatus) -> None:
        for target in st.record.targets:
            module = sys.modules.get(target.module)
            # a circular import still executing the module: its own hook will come
            if target in st.installed or module is None or (target.module not in self._hooking() and executing(module)):
                continue
            try:
                self._install_target(st, target, module)
            except Exception:
                self._uninstall(st)  # all or nothing for what is installable now
                raise
        with self._lock:
            if st.installed and st.state is not State.APPLIED:
                set_state(st, State.APPLIED, None if st.verified else st.decision.reason)
        if not st.installed:
            self._declined(st)

    def _declined(self, st: PatchStatus) -> bool:
        """True (and the patch settled as not needed) when every builder whose target is imported declines."""
        seen = False
        for target in st.record.targets:
            module = sys.modules.get(target.module)
            if target.kind is not Kind.REPLACE:
                return False
            original = self.upstream_original(target, module) if module is not None else _MISSING
            if original is _MISSING or module is None:
                if target.optional:
                    continue  # may never exist in this release; imported later, its own hook decides again
                return False
            if self._build(st, target, surgery.owner_of(target, module), original) is not original:
                return False
            seen = True
        if seen:
            why = f"{st.decision.reason}; nothing to change here: the patch declined this backend (see its record)"
            set_state(st, State.NOT_NEEDED, why)
        return seen

    @staticmethod
    def _build(st: PatchStatus, target: Target, owner: Any, original: Any) -> Any:
        """The builder's result for ``original`` (:func:`kvpatch.surgery.build`), built once per original."""
        built = st.built.get(target)
        if built is not None and built[0] is original:
            return built[1]
        function = surgery.build(st.record, owner, original, st.record.builders[target])
        st.built[target] = (original, function)
        return function

    def _install_target(self, st: PatchStatus, target: Target, module: types.ModuleType) -> None:
        """Install one target; one reaching the replacement already (re-exported, or wrapped) is adopted."""
        patch = st.record
        owner = surgery.owner_of(target, module)
        present = inspect.getattr_static(owner, target.attribute, _MISSING)
        if present is not _MISSING and surgery.carries(present, patch.id):
            with self._lock:
                note = f"{target.path}: already carries kvpatch's {patch.id}"
                if note not in st.notes:
                    st.notes.append(note)
                if st.state is State.PENDING:
                    set_state(st, State.APPLIED, f"{st.decision.reason}; its replacement is in place already")
            return
        proxy = self._spliced.get((id(owner), target.attribute))
        if proxy is not None and present is proxy:
            # a restore spliced the original in under a foreign proxy: the fix goes back under it too, on top of what
            # it wraps now (the original, or a patch below this one on the same attribute)
            inner = surgery.wrapped_by(proxy)
            function = self._build(st, target, owner, inner)
            if function is inner:
                return
            function = surgery.mark(patch, target, owner, inner, function)
            with self._lock:
                st.built.pop(target, None)
                if surgery.splice_under(proxy, inner, function):
                    self._changes.append(Change(patch.id, target, owner, target.attribute, inner, inner, function))
                    st.installed.append(target)
            return
        if proxy is not None:  # the proxy changed or went: install afresh
            with self._lock:
                self._spliced.pop((id(owner), target.attribute), None)

        def record(change: Change) -> None:
            st.built.pop(target, None)  # a build is installed once: another install builds afresh
            self._changes.append(change)
            st.installed.append(target)

        make = partial(self._build, st, target, owner)
        change = surgery.install(patch, target, owner, make=make, lock=self._lock, record=record)
        if change is not None and isinstance(owner, types.ModuleType) and change.original is not None:
            # late activation: any module may hold the original by name; at a fresh import only upstream's can
            everywhere = target.module not in self._hooking()
            surgery.rebind_aliases(change.original, change.function, skip=owner, everywhere=everywhere)

    def upstream_original(self, target: Target, module: types.ModuleType) -> Any:
        """The upstream object at ``target``, looking through kvpatch's own replacements (``_MISSING``: none)."""
        owner = surgery.owner_of(target, module)
        if owner is _MISSING:
            return _MISSING
        first = next((c for c in self._changes if c.owner is owner and c.name == target.attribute), None)
        if first is not None and first.raw_original is not _MISSING:
            return getattr(first.raw_original, "__func__", first.raw_original)
        static = inspect.getattr_static(owner, target.attribute, _MISSING)
        # only kvpatch's own objects (an attribute a patch added): no upstream code to compare
        return next((o for o in surgery.reachable(static, closures=False) if surgery.mark_of(o) is None), _MISSING)

    def _uninstall(self, st: PatchStatus) -> None:
        """Remove one patch's changes, keeping patches stacked above it on the same attributes."""
        with self._lock:
            mine = [c for c in self._changes if c.patch_id == st.patch.id]
            st.installed.clear()
            if not mine:
                return
            keys = {(id(c.owner), c.name) for c in mine}
            later = self._changes[self._changes.index(mine[0]) :]
            undo = [c for c in reversed(later) if (id(c.owner), c.name) in keys]  # this patch's and those above it
            self._drop(undo)
        for change in undo:
            note = surgery.restore(change)
            if change.spliced_into is not None:
                with self._lock:
                    self._spliced[(id(change.owner), change.name)] = change.spliced_into
            if note:
                self.status[change.patch_id].notes.append(note)
                emit(f"kvpatch: {note}", key=f"restore:{change.target.path}:{note}")
        for pid in dict.fromkeys(c.patch_id for c in undo):
            restored = self.status[pid]
            for hook in restored.record.restore_hooks:
                try:
                    hook()
                except Exception as exc:  # noted and warned about once, never raised
                    note = f"restore hook {getattr(hook, '__qualname__', hook)} raised: {failure(exc)}"
                    with self._lock:
                        if note not in restored.notes:
                            restored.notes.append(note)
                    emit(f"kvpatch: {pid}: {note}", key=f"restore-hook:{pid}")
        for change in reversed(undo):  # reinstall what was stacked above, on top of the restored original
            module = sys.modules.get(change.target.module)
            if change.patch_id != st.patch.id and module is not None:
                self._install_target(self.status[change.patch_id], change.target, module)

    def _drop(self, changes: list[Change]) -> None:
        for change in changes:
            self._changes.remove(change)
            installed = self.status[change.patch_id].installed
            if change.target in installed:
                installed.remove(change.target)

    def _fail(self, st: PatchStatus, exc: BaseException, state: State = State.FAILED) -> None:
        with suppress(Exception):  # restoring failed too: the first error is the one to report
            self._uninstall(st)
        error = failure(exc)
        set_state(st, state, f"{state.value}: {error}", error=error)
        emit(f"kvpatch: patch {st.patch.id} is not applied ({state.value}): {st.error}", key=f"fail:{st.patch.id}")

    def refresh(self) -> None:
        """Re-read every installed replacement; a reloaded target module (no hook fires) is patched again first."""
        with self._lock:
            stale = [c for c in self._changes if _reexecuted(c)]
            self._drop(stale)
            self._orphans.extend(stale)
        for pid in dict.fromkeys(c.patch_id for c in stale):
            if self.status[pid].state in (State.APPLIED, State.OVERRIDDEN):
                self._advance(self.status[pid])
        with self._lock:
            changes = list(self._changes)
        for pid in dict.fromkeys(c.patch_id for c in changes):
            refresh_status(self.status[pid], [c for c in changes if c.patch_id == pid], self._lock)

    def suspend(self, patch_id: str) -> None:
        st = self.status[patch_id]
        st.suspended = True
        self._uninstall(st)

    def resume(self, patch_id: str) -> None:
        st = self.status[patch_id]
        st.suspended = False
        if st.state in (State.APPLIED, State.OVERRIDDEN):
            self._install_available(st)

    @contextmanager
    def without(self, *patch_ids: str) -> Iterator[None]:
        """Run a block with the named patches removed: outermost first, back innermost first (a stack is kept)."""
        ids = [pid for pid in patch_ids if self.status[pid].installed or self.status[pid].state is State.APPLIED]
        with self._lock:
            order = list(dict.fromkeys(c.patch_id for c in self._changes))
        ids.sort(key=lambda pid: order.index(pid) if pid in order else len(order))
        for pid in reversed(ids):
            self.suspend(pid)
        try:
            yield
        finally:
            for pid in ids:
                self.resume(pid)

    def changes(self) -> list[tuple[str, str]]:
        with self._lock:
            return [(c.patch_id, c.target.path) for c in self._changes]


#: Every engine of this process, for :func:`_after_fork`.
_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def _after_fork() -> None:
    """In a child of ``os.fork`` only the forking thread lives on: a lock another thread held, and that thread's
    bookkeeping, would stay forever. Each engine gets a fresh lock and per-thread state (as ``logging`` does)."""
    for engine in list(_ENGINES):
        engine._lock = threading.RLock()
        engine._local = threading.local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def hook_registry() -> Any:
    """``register_post_import_hook(hook, name)`` of kvpatch's bootstrap: it never imports inside the import lock."""
    registry = hooks()
    if registry is None:
        raise BrokenInstall("kvpatch's post-import hooks (_kvpatch_hooks) cannot be loaded: reinstall kvpatch")
    return registry.register_post_import_hook


def import_target_modules(patch: Patch, failed: Callable[[str, Exception], None] | None = None) -> None:
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


def compute_on_cpu() -> None:
    """Make this verification process (``kvpatch verify``, ``status --verify``) compute on the CPU before it imports
    upstream: upstream binds its generation stream to the default device at import (``mlx_lm.generate``), where a
    reproduction's CPU stream does not reach, so a logic bug's reproduction would still meet the GPU's arithmetic and
    its missing kernels there. It is kvpatch's own process; a reproduction of a device's bug still runs on the GPU."""
    with suppress(ImportError):
        mx: Any = importlib.import_module("mlx.core")
        mx.set_default_device(mx.cpu)


def set_state(st: PatchStatus, state: State, reason: str | None = None, *, error: Any = _MISSING) -> None:
    """The one place a patch's state changes (``reason`` None / ``error`` unset: kept), under the engine's lock."""
    st.state = state
    if reason is not None:
        st.reason = reason
    if error is not _MISSING:
        st.error = error


def refresh_status(st: PatchStatus, changes: list[Change], lock: threading.RLock) -> None:
    """Re-read ``st``'s installed replacements outside ``lock``, set under it: "applied" means reachable now."""
    results = [surgery.liveness(change) for change in changes]
    with lock:
        gone = [detail for state, detail in results if state in ("overridden", "removed")]
        st.wrapped = [detail for state, detail in results if state == "wrapped"]
        if gone and st.state is State.APPLIED:
            set_state(st, State.OVERRIDDEN, "; ".join(gone))
        elif not gone and st.state is State.OVERRIDDEN:
            set_state(st, State.APPLIED, st.decision.reason)


def _reexecuted(change: Change) -> bool:
    """True when ``change``'s module was executed again (``importlib.reload``): a new owner or module function."""
    module = sys.modules.get(change.target.module)
    if module is None or executing(module):
        return False
    owner = surgery.owner_of(change.target, module)
    if owner is not change.owner:
        return owner is not _MISSING
    current = vars(owner).get(change.name, _MISSING)
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
