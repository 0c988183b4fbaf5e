"""The lifecycle of kvpatch in one process: decide once (the gate), hook each target module, and install there what is
decided: by a version fact, or by the verdict stored for this environment (a hook never measures: a verification
process's :class:`kvpatch.verifier.Verifier` does, outside every import). :mod:`kvpatch.installer` makes the changes
(through :mod:`kvpatch.surgery`); every state change is :meth:`Engine.set_state`'s, under the engine's lock.

The lock guards the engine's bookkeeping only: it is never held while importing, building a replacement (builders
may import), registering hooks or warning. Nothing in a hook raises: errors become the patch's state and a warning.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from . import registry
from ._warn import KvpatchWarning, emit, failure
from .activation import Activation
from .config import Config, read_config
from .detect import Upstream, detect
from .gate import Action, Decision, decide
from .installer import Installer
from .record import Patch
from .registry import Stub
from .states import OF_ACTION, PatchStatus, Reason, State, decided
from .surgery import MISSING
from .verifier import Measurement, measure

__all__ = ["Engine", "KvpatchWarning", "PatchStatus", "State"]


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
        return PatchStatus(patch, decision, OF_ACTION[decision.action], decided(decision))

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
        """Hook the target modules of every patch that may apply (:meth:`kvpatch.activation.Activation.on`)."""
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
                    self.set_state(st, State.PENDING, decided(st.decision))
        self.installer.restore_orphans()

    def measure(self, patch: Patch, *, install: bool = True, device: str | None = None) -> Measurement:
        """kvpatch's one "with and without" of ``patch``'s reproduction (:func:`kvpatch.verifier.measure`)."""
        return measure(self, patch, install=install, device=device)

    def set_state(self, st: PatchStatus, state: State, why: Reason | None = None, *, error: Any = MISSING) -> None:
        """The one place a patch's state changes (``why`` None / ``error`` unset: kept), under the engine's lock."""
        with self.lock:
            st.state = state
            if why is not None:
                st.why = why
            if error is not MISSING:
                st.error = error

    def refresh(self) -> None:
        """Re-read every installed replacement ("applied" means reachable now)."""
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
