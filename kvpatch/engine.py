"""Apply and restore patches through post-import hooks.

The engine decides once per process (the gate), registers a wrapt post-import hook per target
module, and when a module arrives installs the patches that apply to it. Replacements are plain
attributes set on the owner (module or class): nothing wraps them per call. Every change is kept in a
restore record (owner, name, whether the owner held the attribute itself, the raw original), so that
removing a patch puts back exactly what was there: an inherited attribute is deleted again rather than
shadowed, and modules that had imported a replaced function by name get the original back.

Nothing in a hook may raise into the user's import: every error is recorded on the patch's status
(state ``failed``), logged, and warned about once with :class:`KvpatchWarning`.
"""

from __future__ import annotations

import enum
import hashlib
import importlib
import inspect
import logging
import sys
import threading
import types
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from . import verdicts
from .config import Config, read_config
from .detect import Upstream, detect
from .gate import Action, Decision, decide
from .record import DISTRIBUTIONS, Finding, Kind, Patch, Target

__all__ = [
    "Engine",
    "KvpatchWarning",
    "PatchStatus",
    "State",
    "fingerprint",
]

log = logging.getLogger(__name__)
_MISSING = object()


class KvpatchWarning(UserWarning):
    """Something about kvpatch's patches needs attention (never raised, only warned)."""


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
    #: The reproduction decides and this environment has no verdict yet (see kvpatch.verdicts): not applied.
    UNVERIFIED = "pending verification"
    #: The environment's verdict is inconclusive (the reproduction hit an error that is not the bug): not applied.
    INCONCLUSIVE = "inconclusive"


_FROM_ACTION = {
    Action.APPLY: State.PENDING,
    Action.VERIFY: State.PENDING,
    Action.NOT_NEEDED: State.NOT_NEEDED,
    Action.OUT_OF_RANGE: State.OUT_OF_RANGE,
    Action.NOT_INSTALLED: State.NOT_INSTALLED,
    Action.DISABLED: State.DISABLED,
    Action.OPT_IN: State.OPT_IN,
}


@dataclass
class _Change:
    """One attribute changed on one owner: how to put it back."""

    patch_id: str
    target: Target
    owner: Any
    name: str
    had_own: bool
    raw_original: Any
    replacement: Any
    aliases: list[tuple[types.ModuleType, str]] = field(default_factory=list)


@dataclass
class PatchStatus:
    """What happened to one patch in this process."""

    patch: Patch
    decision: Decision
    state: State
    reason: str
    error: str | None = None
    #: Notes about target code that differs from what the patch was validated on.
    drift: list[str] = field(default_factory=list)
    #: Outcome of a reproduction run by the engine itself (drift or VERIFY decisions).
    verified: str | None = None
    installed: list[Target] = field(default_factory=list)
    suspended: bool = False
    #: Targets whose source fingerprint has been checked already.
    fingerprinted: set[Target] = field(default_factory=set)

    @property
    def needs_verify(self) -> bool:
        return self.decision.action is Action.VERIFY or bool(self.drift)


def fingerprint(obj: Any) -> str | None:
    """A short hash of an object's source text (blank lines and indentation normalised).

    Source, not bytecode, so the same upstream code has the same fingerprint on every Python.
    ``None`` when the source cannot be read.
    """
    func = inspect.unwrap(obj) if callable(obj) else obj
    func = getattr(func, "__func__", func)
    try:
        text = inspect.getsource(func)
    except (OSError, TypeError):
        return None
    lines = [line.strip() for line in text.splitlines()]
    body = "\n".join(line for line in lines if line and not line.startswith("#"))
    return hashlib.sha256(body.encode()).hexdigest()[:12]


class Engine:
    """Installs a set of patches into this process. Create it with :func:`kvpatch.activate`."""

    def __init__(
        self,
        patches: Iterable[Patch],
        *,
        upstream: dict[str, Upstream] | None = None,
        config: Config | None = None,
        broken: dict[str, str] | None = None,
    ) -> None:
        self.patches = sorted(patches, key=lambda p: (p.order, p.id))
        self.upstream = upstream if upstream is not None else detect()
        known = frozenset(p.id for p in self.patches)
        self.config = config if config is not None else read_config(known_ids=known)
        self.broken = dict(broken or {})
        self.status: dict[str, PatchStatus] = {}
        self._changes: list[_Change] = []  # in install order
        self._hooked: set[str] = set()
        self._ready: set[str] = set()  # top-level upstream packages fully imported
        self._hooking: set[str] = set()  # modules whose post-import hook is running now
        self._warned: set[str] = set()
        self._lock = threading.RLock()
        self._active = False
        for problem in self.config.problems:
            self.warn(problem, key=f"config:{problem}")
        for module, error in self.broken.items():
            self.warn(f"patch module {module} could not be loaded: {error}", key=f"broken:{module}")
        for patch in self.patches:
            self.status[patch.id] = self._decide(patch)

    # -- decisions ---------------------------------------------------------------------------------
    def _decide(self, patch: Patch) -> PatchStatus:
        try:
            upstream = self.upstream.get(patch.distribution) or Upstream(patch.distribution, None)
            decision = decide(patch, upstream, self.config)
        except Exception as exc:  # the gate is pure, but a broken record must not break imports
            decision = Decision(Action.DISABLED, "gate raised")
            return PatchStatus(patch, decision, State.FAILED, "the gate raised", error=_describe(exc))
        return PatchStatus(patch, decision, _FROM_ACTION[decision.action], decision.reason)

    # -- activation --------------------------------------------------------------------------------
    def activate(self) -> None:
        """Register the post-import hooks (patches modules already imported right away)."""
        with self._lock:
            if self._active:
                return
            self._active = True
            modules: dict[str, None] = {}
            packages: dict[str, None] = {}
            for st in self.status.values():
                if st.state is State.PENDING:
                    packages[st.patch.import_name] = None
                    for module in st.patch.modules:
                        modules[module] = None
            if not modules:
                return
            import wrapt

            for name in [*packages, *modules]:
                if name in self._hooked:  # re-activation: wrapt will not call us again for these
                    if name in sys.modules:
                        self._hook(sys.modules[name])
                    continue
                self._hooked.add(name)
                try:
                    wrapt.register_post_import_hook(self._hook, name)
                except Exception as exc:  # pragma: no cover - wrapt itself failing
                    self.warn(f"could not hook {name}: {exc}", key=f"hook:{name}")

    def deactivate(self) -> None:
        """Restore every original; hooks stay registered but do nothing until re-activated."""
        with self._lock:
            self._active = False
            for st in self.status.values():
                if st.installed:
                    self._uninstall(st)
                    if st.state is State.APPLIED:
                        st.state = State.PENDING
                        st.reason = st.decision.reason

    def _hook(self, module: types.ModuleType) -> None:
        # Runs inside the user's import statement: it must never raise.
        try:
            with self._lock:
                if not self._active:
                    return
                name = module.__name__
                self._hooking.add(name)
                try:
                    self._dispatch(name)
                finally:
                    self._hooking.discard(name)
        except Exception as exc:  # pragma: no cover - defensive: _advance catches its own errors
            self.warn(f"kvpatch hook for {getattr(module, '__name__', module)} failed: {exc}", key="hook-crash")

    def _dispatch(self, name: str) -> None:
        if name in DISTRIBUTIONS.values():
            self._ready.add(name)
            for st in self._in_order():
                if st.state is State.PENDING and st.patch.import_name == name:
                    self._advance(st)
            return
        for st in self._in_order():
            if st.state in (State.PENDING, State.APPLIED) and name in st.patch.modules:
                self._advance(st)

    def _in_order(self) -> Iterator[PatchStatus]:
        return iter([self.status[p.id] for p in self.patches])

    # -- the life of one patch ---------------------------------------------------------------------
    def _advance(self, st: PatchStatus) -> None:
        """Install whatever of ``st`` can be installed now; verify first where the facts say so."""
        if st.suspended:
            return
        try:
            if not st.verified:
                self._check_drift(st)
                if st.needs_verify:
                    if not self._package_ready(st.patch.import_name):
                        return  # wait until the package is fully imported: reproductions import freely
                    if st.installed:
                        self._uninstall(st)  # a newly arrived target drifted: judge the whole patch
                    self._verify_and_apply(st)
                    return
            self._install_available(st)
        except Exception as exc:
            self._fail(st, exc)

    def _package_ready(self, name: str) -> bool:
        """True once the upstream package has finished importing (reproductions may import freely)."""
        if name in self._ready:
            return True
        module = sys.modules.get(name)
        if module is not None and not _executing(module):
            self._ready.add(name)
            return True
        return False

    def _check_drift(self, st: PatchStatus) -> None:
        """Compare each replaced target's source fingerprint with those recorded for the affected releases.

        The recorded ones are shipped data (``kvpatch/data/fingerprints.json``, read once); a target's own
        fingerprint is cached by its file's stat (:func:`kvpatch.verdicts.fingerprint_cached`), so a
        verified environment reads no source here. A mismatch sends the patch to its verdict.
        """
        patch = st.patch
        if st.decision.action is Action.VERIFY:
            return  # the verdict decides whatever the code is (its key covers the target files)
        known = verdicts.validated(patch)
        if not known:
            return
        for target in patch.targets:
            recorded = known.get(target.path)
            if target.kind is not Kind.REPLACE or target in st.fingerprinted or not recorded:
                continue
            module = sys.modules.get(target.module)
            if module is None:
                continue
            original = self._upstream_original(target, module)
            if original is _MISSING:
                continue
            st.fingerprinted.add(target)  # once per target per process
            fp = verdicts.fingerprint_cached(original, fingerprint)
            if fp not in recorded:
                st.drift.append(
                    f"{target.path} has source fingerprint {fp}, none of the {len(recorded)} recorded for "
                    f"{patch.distribution} releases in {patch.affected}"
                )
        verdicts.save_fingerprints(wait=verdicts.measuring() is not None)

    def _verify_and_apply(self, st: PatchStatus) -> None:
        """Settle a patch that the facts leave to its reproduction, from this environment's verdict.

        In the user's process this only reads the verdict cache (:mod:`kvpatch.verdicts`): no reproduction
        runs and no global state changes. With no verdict the patch is not applied (``pending
        verification``) and one background verification is requested. Only a verification process
        (``kvpatch verify``, ``status --verify``, the background child) measures here and stores the verdict.
        """
        patch = st.patch
        why = "; ".join(st.drift) or st.decision.reason
        verdict_key = verdicts.key(patch, self.upstream)
        found = None if verdicts.remeasure() else verdicts.lookup(verdict_key)
        by = verdicts.measuring()
        if found is None and by is not None:
            if patch.id in verdicts.MEASURING:
                return  # a hook fired by this very measurement (importing the targets): the outer call decides
            verdicts.MEASURING.add(patch.id)
            try:
                import_target_modules(patch)
                before = run_reproduction(patch)
                after = None
                if before.verdict == "present":
                    self._install_available(st)
                    try:
                        after = run_reproduction(patch)
                    finally:
                        self._uninstall(st)
            finally:
                verdicts.MEASURING.discard(patch.id)
            found = verdicts.from_findings(before, after, by=by)
            verdicts.store(verdict_key, patch, found, self.upstream)
        if found is None:
            st.state = State.UNVERIFIED
            st.reason = f"{why}; {verdicts.request_verification([verdict_key])}"
            return
        st.verified = found.describe()
        st.reason = f"{why}; verdict: {st.verified}"
        if found.outcome == verdicts.FIXED:
            st.state = State.PENDING  # installed now for the modules already imported, by their hooks later
            self._install_available(st)
            if st.drift:
                self.warn(
                    f"kvpatch: {patch.id} applied to drifted code after its reproduction confirmed it: {why}",
                    key=f"drift:{patch.id}",
                )
        elif found.outcome == verdicts.ABSENT:
            st.state = State.NOT_NEEDED
        elif found.outcome == verdicts.INCONCLUSIVE:
            st.state, st.error = State.INCONCLUSIVE, found.detail
            st.reason = f"{why}; the reproduction was inconclusive here ({found.detail}): not applied"
            self.warn(f"kvpatch: {patch.id} not applied: {st.reason}", key=f"verdict:{patch.id}")
        elif found.outcome == verdicts.SKIPPED and not st.drift:
            st.state = State.NOT_NEEDED
            st.reason = f"{why}; the reproduction cannot run on this backend ({found.detail}): not applied"
        else:  # NOT_FIXED, or SKIPPED on drifted code
            st.state = State.DRIFTED
            st.reason = f"{why}; verdict: {st.verified}: not applied"
            self.warn(f"kvpatch: {patch.id}: {st.reason}", key=f"drift:{patch.id}")

    def _install_available(self, st: PatchStatus) -> None:
        patch = st.patch
        done = {(t.module, t.qualname) for t in st.installed}
        for target in patch.targets:
            if (target.module, target.qualname) in done:
                continue
            module = sys.modules.get(target.module)
            if module is None or (target.module not in self._hooking and _executing(module)):
                continue  # not imported yet, or still executing (a circular import): its own hook will come
            try:
                change = self._install_target(patch, target, module)
            except Exception:
                self._uninstall(st)  # all or nothing for what is installable now
                raise
            if change is not None:
                st.installed.append(target)
        if st.installed:
            st.state = State.APPLIED
            if not st.verified:
                st.reason = st.decision.reason

    def _install_target(self, patch: Patch, target: Target, module: types.ModuleType) -> _Change | None:
        owner: Any = module
        for part in target.owner_path:
            owner = getattr(owner, part, _MISSING)
            if owner is _MISSING:
                if target.optional:
                    return None
                raise TargetMissing(f"{target.path}: {'.'.join(target.owner_path)} not found in {target.module}")
        name = target.attribute
        own = vars(owner)
        had_own = name in own
        raw = own[name] if had_own else _MISSING
        if target.kind is Kind.REPLACE:
            try:
                static = inspect.getattr_static(owner, name)
            except AttributeError:
                if target.optional:
                    return None
                raise TargetMissing(f"{target.path} not found (moved or removed upstream?)") from None
            wrapper_type = type(static) if isinstance(static, (classmethod, staticmethod)) else None
            original = static.__func__ if wrapper_type else getattr(owner, name)
            replacement = patch.builders[target](original)
            if replacement is original:
                return None  # the builder declined: this target needs no change here
            if wrapper_type is not None:
                replacement = wrapper_type(replacement)
        else:
            if hasattr(owner, name):
                raise TargetMissing(
                    f"{target.path} already exists upstream: either upstream fixed it (retire this patch) "
                    "or it moved (retarget it)"
                )
            original = None
            replacement = patch.builders[target](None)
        setattr(owner, name, replacement)
        change = _Change(patch.id, target, owner, name, had_own, raw, replacement)
        if isinstance(owner, types.ModuleType) and original is not None:
            change.aliases = _rebind_aliases(original, replacement, skip=owner)
        self._changes.append(change)
        return change

    def _upstream_original(self, target: Target, module: types.ModuleType) -> Any:
        """The upstream object at ``target``, looking through kvpatch's own changes."""
        owner: Any = module
        for part in target.owner_path:
            owner = getattr(owner, part, _MISSING)
            if owner is _MISSING:
                return _MISSING
        for change in self._changes:
            if change.owner is owner and change.name == target.attribute:
                raw = change.raw_original
                if raw is _MISSING:
                    break
                return getattr(raw, "__func__", raw)
        try:
            static = inspect.getattr_static(owner, target.attribute)
        except AttributeError:
            return _MISSING
        return getattr(static, "__func__", static)

    def _uninstall(self, st: PatchStatus) -> None:
        """Remove one patch's changes, keeping patches stacked above it on the same attributes."""
        mine = [c for c in self._changes if c.patch_id == st.patch.id]
        if not mine:
            st.installed.clear()
            return
        keys = {(id(c.owner), c.name) for c in mine}
        first = min(self._changes.index(c) for c in mine)
        above = [c for c in self._changes[first:] if c.patch_id != st.patch.id and (id(c.owner), c.name) in keys]
        for change in reversed(self._changes[first:]):
            if change in mine or change in above:
                _restore(change)
                self._changes.remove(change)
        st.installed.clear()
        for change in above:  # reinstall what was stacked above, on top of the restored original
            patch = self.status[change.patch_id].patch
            module = sys.modules[change.target.module]
            new = self._install_target(patch, change.target, module)
            if new is None:  # pragma: no cover - the owner vanished meanwhile
                continue

    def _fail(self, st: PatchStatus, exc: BaseException) -> None:
        try:
            self._uninstall(st)
        except Exception as inner:  # pragma: no cover - restoring failed too
            log.error("kvpatch: restoring %s failed: %s", st.patch.id, inner)
        st.state = State.FAILED
        st.error = _describe(exc)
        st.reason = f"failed: {st.error}"
        self.warn(f"kvpatch: patch {st.patch.id} failed and is not applied: {st.error}", key=f"fail:{st.patch.id}")

    # -- public helpers ----------------------------------------------------------------------------
    def warn(self, message: str, *, key: str) -> None:
        """Log and warn once per key."""
        if key in self._warned:
            return
        self._warned.add(key)
        log.warning("%s", message)
        warnings.warn(message, KvpatchWarning, stacklevel=3)

    def suspend(self, patch_id: str) -> None:
        """Take one patch out (restoring the originals) without forgetting its decision."""
        with self._lock:
            st = self.status[patch_id]
            st.suspended = True
            self._uninstall(st)

    def resume(self, patch_id: str) -> None:
        with self._lock:
            st = self.status[patch_id]
            st.suspended = False
            if st.state is State.APPLIED:
                self._install_available(st)

    @contextmanager
    def without(self, *patch_ids: str) -> Iterator[None]:
        """Run a block with the named patches removed (for reproductions and tests)."""
        ids = [pid for pid in patch_ids if self.status[pid].installed or self.status[pid].state is State.APPLIED]
        for pid in ids:
            self.suspend(pid)
        try:
            yield
        finally:
            for pid in reversed(ids):
                self.resume(pid)

    def changes(self) -> list[tuple[str, str]]:
        return [(c.patch_id, c.target.path) for c in self._changes]


class TargetMissing(LookupError):
    """A target attribute is not where the patch expects it."""


def import_target_modules(patch: Patch) -> None:
    """Import every module the patch targets, so that the engine's hooks have run for them.

    A module that holds only optional targets may fail to import in any way (some upstream modules
    raise RuntimeError at import without Metal): its targets count as absent. Any other failure raises.
    """
    for module in patch.modules:
        try:
            importlib.import_module(module)
        except Exception:
            if not all(t.optional for t in patch.targets if t.module == module):
                raise


#: Ids of the reproductions run in this process, in order: the proof, read by tests, that a user's import
#: ran none (verdicts are measured by ``kvpatch verify`` or a background child; see kvpatch.verdicts).
REPRODUCTIONS_RUN: list[str] = []


def run_reproduction(patch: Patch) -> Finding:
    """Run ``patch``'s reproduction: present, absent, or inconclusive (an error that is not the bug's symptom).

    mlx's global random state, default device and default stream are saved and put back, so a
    reproduction leaves no trace in the process that ran it.
    """
    if patch.reproduction is None:
        raise LookupError(f"{patch.id} has no reproduction")
    REPRODUCTIONS_RUN.append(patch.id)
    with _mlx_state_kept():
        try:
            finding = patch.reproduction()
        except Exception as exc:
            return Finding.from_error(exc)
    if not isinstance(finding, Finding):
        raise TypeError(f"{patch.id}: reproduction returned {finding!r}, not a Finding")
    return finding


@contextmanager
def _mlx_state_kept() -> Iterator[None]:
    """Put mlx's default device and stream back after a block, and its random state where mlx allows it.

    mlx up to 0.31 keeps the global key in a plain list, which is restored. Newer mlx keeps it in an
    opaque ``_RandomState`` that cannot be set back, which is one reason reproductions never run in a
    user's process (verdicts are settled by ``kvpatch verify`` or in a child process).
    """
    mx = sys.modules.get("mlx.core")
    if mx is None:
        import mlx.core as mx
    state = getattr(mx.random, "state", None)
    saved = list(state) if isinstance(state, list) else None
    device = mx.default_device()
    stream = mx.default_stream(device)
    try:
        yield
    finally:
        if saved is not None and isinstance(state, list):
            state[:] = saved
        mx.set_default_device(device)
        mx.set_default_stream(stream)


def _executing(module: types.ModuleType) -> bool:
    """True while ``module``'s own code is still running (importlib marks its spec)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _restore(change: _Change) -> None:
    if change.had_own:
        setattr(change.owner, change.name, change.raw_original)
    else:
        try:
            delattr(change.owner, change.name)
        except AttributeError:  # pragma: no cover - someone else removed it
            pass
    if isinstance(change.owner, types.ModuleType) and change.raw_original is not _MISSING:
        # Modules that imported the replacement by name (before or after the patch) get the original back.
        _rebind_aliases(
            change.replacement, getattr(change.raw_original, "__func__", change.raw_original), skip=change.owner
        )


def _rebind_aliases(original: Any, replacement: Any, *, skip: types.ModuleType) -> list[tuple[types.ModuleType, str]]:
    """Rebind names that upstream modules imported from the owner before the patch was installed."""
    found: list[tuple[types.ModuleType, str]] = []
    prefixes = tuple(f"{pkg}." for pkg in DISTRIBUTIONS.values())
    for mod_name, module in list(sys.modules.items()):
        if module is None or module is skip:
            continue
        if not (mod_name.startswith(prefixes) or mod_name in DISTRIBUTIONS.values()):
            continue
        for name, value in list(vars(module).items()):
            if value is original:
                setattr(module, name, replacement)
                found.append((module, name))
    return found


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
