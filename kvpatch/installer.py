"""The changes one engine made to upstream's objects: each patch's replacements installed through
:func:`kvpatch.surgery.install` (the one install path, under another library's wrapt proxy too), taken out again
keeping the patches stacked above on the same attributes, and looked up again ("applied" means reachable now).
Every state change goes through :meth:`kvpatch.engine.Engine.set_state`, under the engine's lock."""

from __future__ import annotations

import inspect
import sys
import threading
import types
from functools import partial
from typing import TYPE_CHECKING, Any

from . import surgery
from ._warn import emit, failure
from .record import Kind, Target
from .states import PatchStatus, Reason, State, decided
from .surgery import MISSING, Change

if TYPE_CHECKING:
    from .engine import Engine


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
        """Install each target of ``st`` whose module is imported, all or nothing: then applied (not needed where
        every builder declines)."""
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
                self.engine.set_state(st, State.APPLIED, None if st.verified else decided(st.decision))
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
        for pid in dict.fromkeys(c.patch_id for c in undo):
            _restore_hooks(engine, engine.status[pid])
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

    def restore_orphans(self) -> None:
        with self.engine.lock:
            orphans, self.orphans = self.orphans, []
        for change in reversed(orphans):
            surgery.restore(change)

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


def _restore_hooks(engine: Engine, st: PatchStatus) -> None:
    """Run the restore hooks of ``st``'s patch (its changes are out): a failure is noted and warned about once."""
    for hook in st.record.restore_hooks:
        try:
            hook()
        except Exception as exc:  # never raised
            note = f"restore hook {getattr(hook, '__qualname__', hook)} raised: {failure(exc)}"
            with engine.lock:
                st.note(note)
            emit(f"kvpatch: {st.patch.id}: {note}", key=f"restore-hook:{st.patch.id}")


def reached(engine: Engine, st: PatchStatus, changes: list[Change]) -> None:
    """Re-read ``st``'s installed replacements outside the lock, set under it: "applied" means reachable now."""
    results = [surgery.liveness(change) for change in changes]
    with engine.lock:
        gone = [detail for state, detail in results if state in ("overridden", "removed")]
        st.wrapped = [detail for state, detail in results if state == "wrapped"]
        if gone and st.state is State.APPLIED:
            engine.set_state(st, State.OVERRIDDEN, Reason("overridden", by="; ".join(gone)))
        elif not gone and st.state is State.OVERRIDDEN:
            engine.set_state(st, State.APPLIED, decided(st.decision))


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
