"""Vendored copies of upstream code (a server's own copy of a module kvpatch patches has the same bugs): a
registered copy (:func:`register_copy`) is patched when it is imported, with statuses of its own. :func:`scan` reads
source files only: a copy is a function whose fingerprint equals a replaced target's in the installed upstream file.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import itertools
import os
import re
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import config, get_engine, store, surgery
from ._warn import emit, failure
from .detect import Upstream
from .engine import PatchStatus, executing, hook_registry, reached
from .fingerprints import fingerprint, fingerprint_source, validated
from .gate import Action, Decision, decide
from .locate import module_file
from .record import DISTRIBUTIONS, Expiry, Kind, Patch, Target
from .states import OF_ACTION, Reason, State
from .surgery import MISSING, TargetMissing

if TYPE_CHECKING:
    from .engine import Engine

#: Modules known to hold vendored copies of patched upstream code (hooked when ``KVPATCH_VENDORED=1``).
KNOWN: tuple[str, ...] = ("rapid_mlx.models.mlx_vlm_vendored.cache",)
OTHER_OWNER = "found (other owner: not patched)"


@dataclass
class Copy:
    patch_id: str
    target: str  # the upstream target, "module.Qual.name"
    module: str
    qualname: str
    fingerprint: str
    state: str = "found"  # "found", "patched", "not patched: <why>" or OTHER_OWNER

    @property
    def path(self) -> str:
        return f"{self.module}.{self.qualname}"

    def as_dict(self) -> dict[str, str]:
        keys = ("patch", "target", "copy", "fingerprint", "state")
        return dict(zip(keys, (self.patch_id, self.target, self.path, self.fingerprint, self.state), strict=True))


@dataclass
class _Registered:
    engine: Engine
    module: str
    of: str
    scanned: bool  # found by the scan: the installed release's code (else: code the patch was validated on)
    statuses: dict[str, PatchStatus]
    changes: dict[str, list[surgery.Change]] = field(default_factory=dict)


class _Kept(Exception):
    """The copy keeps its code for this patch: it is not the code the patch is for."""


_lock = threading.RLock()
_registered: dict[tuple[str, str], _Registered] = {}  # (module, of) -> registration


def _after_fork() -> None:
    """In a child of ``os.fork``: a lock another thread of the parent held would be held forever."""
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _definitions(source: str, names: frozenset[str]) -> dict[str, tuple[str, str, int]]:
    """``{qualname: (fingerprint, longest line, lines)}`` of the functions in ``names`` at module or class level of
    ``source``. Found by indentation, not parsed (a tenth of ``ast.parse``'s time, no SyntaxWarning)."""
    alternatives = "|".join(sorted(map(re.escape, names)))
    pattern = re.compile(r"^([ \t]*)(?:async[ \t]+)?def[ \t]+(" + alternatives + r")[ \t]*\(", re.M)
    lines = source.split("\n")
    found: dict[str, tuple[str, str, int]] = {}
    for match in pattern.finditer(source):
        row = source.count("\n", 0, match.start())
        indent = len(match.group(1).expandtabs())
        qualname = _enclosing(lines, row, indent, match.group(2))
        if qualname is None:
            continue
        first = row
        while first > 0 and lines[first - 1].strip().startswith("@"):
            first -= 1
        # the block ends before the next code line indented no deeper than the def (a closing ")" is the signature's)
        stop = re.compile(rf"^[ \t]{{0,{indent}}}[^\s#)]", re.M).search(source, match.end())
        block = lines[first : source.count("\n", 0, stop.start()) if stop else len(lines)]
        kept = [text for text in map(str.strip, block) if text and not text.startswith("#")]
        found[qualname] = (fingerprint_source("\n".join(block)), max(kept, key=len), len(kept))
    return found


def _enclosing(lines: list[str], row: int, indent: int, name: str) -> str | None:
    """The qualified name of a ``def`` at ``row`` (None inside a function or statement)."""
    parts = [name]
    for text in reversed(lines[:row]):
        if indent == 0:
            break
        stripped = text.lstrip()
        if not stripped or stripped.startswith(("#", "@", ")")) or len(text) - len(stripped) >= indent:
            continue
        header = re.match(r"(class|def|async[ \t]+def)[ \t]+(\w+)", stripped)
        if header is None and (stripped.startswith(('"', "'")) or text[:1].isspace()):
            continue  # a continuation line or a string inside something
        if header is None or header.group(1) != "class":
            return None  # in a function, or in module-level code (if/try): not a stable name
        parts.append(header.group(2))
        indent = len(text) - len(stripped)
    return ".".join(reversed(parts))


def _read(path: str | None) -> str:
    """The text of a ``.py`` file ("" unless it is a regular file of bounded size)."""
    data = store.read_bytes(Path(path)) if path and path.endswith(".py") else None
    return data.decode(errors="replace") if data else ""


def _upstream_fingerprints(engine: Engine) -> dict[str, list[tuple[str, Target, str]]]:
    """``{fingerprint: [(patch id, target, longest line)]}`` of the replaced targets of patches that apply (or wait)."""
    out: dict[str, list[tuple[str, Target, str]]] = {}
    texts: dict[str, dict[str, tuple[str, str, int]]] = {}
    patches = engine.materialise()
    for patch in patches:
        st = engine.status[patch.id]
        pending = st.decision.action is Action.APPLY and st.state in (State.PENDING, State.OVERRIDDEN)
        for target in patch.targets if st.state is State.APPLIED or st.installed or pending else ():
            if target.kind is Kind.REPLACE and target.module not in texts:
                wanted = frozenset(t.attribute for p in patches for t in p.targets if t.module == target.module)
                texts[target.module] = _definitions(_read(module_file(target.module)), wanted)
            found = texts.get(target.module, {}).get(target.qualname) if target.kind is Kind.REPLACE else None
            if found is not None:
                out.setdefault(found[0], []).append((patch.id, target, found[1]))
    return out


def _installed_dependents() -> dict[str, str]:
    """``{module: file}`` of the ``.py`` files of installed distributions that require mlx, mlx-lm or mlx-vlm."""
    out: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        needs_mlx = any(re.match(r"mlx([-_]v?lm)?\b", r, re.I) for r in dist.requires or ())
        if name in ("mlx", "mlx-lm", "mlx-vlm", "kvpatch") or not needs_mlx:
            continue
        for file in dist.files or ():
            parts = list(file.with_suffix("").parts)
            if file.suffix == ".py" and all(p.isidentifier() for p in parts):
                out.setdefault(".".join(parts).removesuffix(".__init__"), str(dist.locate_file(file)))
    return out


def scan(engine: Engine, *, modules: Iterable[str] | None = None, installed: bool = False) -> list[Copy]:
    """Copies of the replaced targets of patches that apply here among ``modules`` (default: imported, not upstream's,
    kvpatch's or the standard library's) and, with ``installed``, in installed mlx dependents' files."""
    upstream = _upstream_fingerprints(engine)
    if not upstream:
        return []
    names = frozenset(t.attribute for entries in upstream.values() for _, t, _ in entries)
    # a copy holds each line of the code it copies: its longest line, searched for first, spares most files a parse
    needles = {line for entries in upstream.values() for *_, line in entries}
    skip = {*DISTRIBUTIONS.values(), "kvpatch", "_kvpatch_boot", "kvpatch_pytest", "__main__", *sys.stdlib_module_names}
    names_in = list(sys.modules) if modules is None else modules
    candidates = {name: module_file(name) for name in names_in if name.split(".")[0] not in skip}
    for name, path in _installed_dependents().items() if installed else ():
        candidates.setdefault(name, path)
    with _lock:
        statuses = {(r.module, pid): st for r in _registered.values() for pid, st in r.statuses.items()}
    found: list[Copy] = []
    for module, file in candidates.items():
        source = _read(file)
        for qualname, (fp, _, size) in _definitions(source, names).items() if any(n in source for n in needles) else ():
            for patch_id, target, _ in upstream.get(fp, []):  # the same fingerprint: the same name
                st = statuses.get((module, patch_id))
                if qualname != target.qualname:
                    state = OTHER_OWNER
                elif st is None or st.state is State.PENDING:
                    state = "found"
                else:
                    state = "patched" if st.state is State.APPLIED else f"not patched: {st.reason}"
                if state != OTHER_OWNER or size >= 4:  # same code under another name: ``return True`` says nothing
                    found.append(Copy(patch_id, target.path, module, qualname, fp, state))
    return found


def apply(engine: Engine | None = None, *, modules: Iterable[str] | None = None, force: bool = False) -> None:
    """Register the copies :func:`scan` finds (with ``KVPATCH_VENDORED`` on or ``force``). Never raises."""
    if not (force or config.vendored_modules() is not None):
        return
    try:
        engine = engine or get_engine()
        found: dict[str, dict[str, dict[str, set[str]]]] = {}  # module -> of -> {patch id: its targets found}
        for c in scan(engine, modules=modules):
            if c.state != OTHER_OWNER:
                of = c.target[: -len(c.qualname) - 1]
                found.setdefault(c.module, {}).setdefault(of, {}).setdefault(c.patch_id, set()).add(c.target)
        expected: dict[str, set[Target]] = {}  # patch id -> its targets the scan can find in upstream's files
        for pid, target, _ in itertools.chain.from_iterable(_upstream_fingerprints(engine).values()):
            expected.setdefault(pid, set()).add(target)
        for module, copied in found.items():
            # a copy of one upstream module, the one it shares most with (mlx-vlm's cache shares code with mlx-lm's)
            of, paths = max(copied.items(), key=lambda item: len(set().union(*item[1].values())))
            with _lock:
                if any(m == module for m, _ in _registered):
                    continue  # registered already (in code: as the server declared it)
            # patches found whole only: a copy that changed one of a patch's functions gets none of it
            whole = [
                pid for pid, got in paths.items() if {t.path for t in expected.get(pid, ()) if t.module == of} <= got
            ]
            register_copy(engine, module, of=of, version=None, patches=whole, scanned=True)
    except Exception as exc:  # kvpatch never raises into its host
        emit(f"kvpatch: patching vendored copies failed: {failure(exc)}")


def hook(engine: Engine) -> None:
    """With ``KVPATCH_VENDORED`` on: :func:`apply` to :data:`KNOWN` and the modules it names as they are imported."""
    names = config.vendored_modules()
    try:
        for name in dict.fromkeys([*KNOWN, *names]) if names is not None else ():
            if executing(sys.modules.get(name)):  # activated inside its own import: no hook will come
                emit(f"kvpatch: vendored copy {name} was still being imported: call kvpatch.vendored.apply()")
                continue
            hook_registry()(lambda module: apply(engine, modules=[module.__name__], force=True), name)
    except Exception as exc:
        emit(f"kvpatch: could not hook vendored modules: {failure(exc)}")


def register_copy(
    engine: Engine, module: str, *, of: str, version: str | None, patches: Iterable[str] | None, scanned: bool = False
) -> list[PatchStatus]:
    """:func:`kvpatch.register_copy` (``version`` None: the installed release's)."""
    dist = next((d for d, name in DISTRIBUTIONS.items() if name == of.split(".", 1)[0]), None)
    if dist is None:
        raise ValueError(f"{of} is not a module of {' or '.join(DISTRIBUTIONS)}")
    version = engine.upstream[dist].version or "" if version is None else version
    statuses: dict[str, PatchStatus] = {}
    wanted = None if patches is None else list(dict.fromkeys(patches))
    known = {p.id: p for p in engine.materialise()}
    for patch in known.values():
        if patch.distribution != dist or of not in patch.modules or (wanted is not None and patch.id not in wanted):
            continue
        decision = decide(patch, Upstream(dist, version), engine.config)
        why = Reason("copy", distribution=dist, version=version, of=of, decision=decision.reason)
        state = OF_ACTION[decision.action]
        mine = engine.status[patch.id]
        if decision.action is Action.VERIFY and scanned and mine.verified and mine.installed:
            state, why = State.PENDING, Reason("copy-verdict", copy=why, verdict=mine.verified)
        elif decision.action is Action.VERIFY:
            state, why = State.UNVERIFIED, Reason("copy-unverified", copy=why)
        statuses[patch.id] = PatchStatus(patch, decision, state, why, copy=module)
    for pid in (p for p in wanted or () if p not in statuses):
        said = "no such patch" if pid not in known else f"it does not change {of}"
        record = known.get(pid) or Patch(pid, "unknown patch", dist, "<0", "", Expiry("unknown"), fixed_in="0")
        why = Reason("copy-refused", patch=pid, module=module, why=said)
        statuses[pid] = PatchStatus(record, Decision(Action.DISABLED, said), State.FAILED, why, error=said, copy=module)
    reg = _Registered(engine, module, of, scanned, statuses)
    with _lock:
        earlier = _registered.get((module, of))
        _registered[(module, of)] = reg
    if earlier is not None:
        _restore(earlier)
    hook_registry()(lambda loaded: _patch(reg), module)
    return list(statuses.values())


def _patch(reg: _Registered) -> None:
    """Install every pending patch of ``reg`` on the imported copy, all or nothing per patch."""
    with _lock:
        if _registered.get((reg.module, reg.of)) is not reg:
            return  # registered again since
    for pid, st in reg.statuses.items():
        if st.state is not State.PENDING:
            continue
        done: list[surgery.Change] = []
        try:
            for target in (t for t in st.record.targets if t.module == reg.of):
                known = None if reg.scanned else validated(st.record).get(target.path)
                change = _install(st.record, target, reg.module, known)
                done += [change] if change is not None else []
        except Exception as exc:
            for change in reversed(done):
                surgery.restore(change)
            kept = isinstance(exc, _Kept)
            state = State.DRIFTED if kept else State.TARGET_MISSING if isinstance(exc, TargetMissing) else State.FAILED
            why = str(exc) if kept else failure(exc)
            reg.engine.set_state(
                st, state, Reason("copy-not-applied", copy=st.reason, why=why), error=None if kept else why
            )
            if state is State.FAILED:
                emit(f"kvpatch: vendored copy {reg.module}: {st.reason}", key=f"vendored:{pid}:{reg.module}")
            continue
        with _lock:
            reg.changes[pid] = done
        with reg.engine.lock:
            st.installed = [c.target for c in done]
            declined = Reason("copy-declined", copy=st.reason)
            reg.engine.set_state(st, State.APPLIED if done else State.NOT_NEEDED, MISSING if done else declined)


def _install(patch: Patch, target: Target, module: str, known: frozenset[str] | None) -> surgery.Change | None:
    """``target``'s fix on the copy, where its code is its own (and, with ``known``, has one of those fingerprints)."""

    def check(original: Any) -> None:
        # a plain value (a class attribute a patch serves through a property) has no code to compare
        probe: Any = (original.fset or original.fget) if isinstance(original, property) else original
        if callable(probe) and surgery.foreign(inspect.unwrap(probe), module):
            raise _Kept(f"{module}.{target.qualname} is not the copy's own code (replaced after import)")
        if known and fingerprint(original) not in (*known, None):  # None: a builtin, or a plain value
            raise _Kept(f"{module}.{target.qualname} is not code the patch was decided on")

    where = Target(module, target.qualname, target.kind, target.optional)
    return surgery.install(patch, target, surgery.owner_of(where, sys.modules[module]), at=where, check=check)


def _restore(reg: _Registered) -> None:
    with _lock:
        changes, reg.changes = reg.changes, {}
    for pid, done in changes.items():
        for note in filter(None, (surgery.restore(change) for change in reversed(done))):
            emit(f"kvpatch: vendored copy: {note}")
        st = reg.statuses[pid]
        with reg.engine.lock:
            st.installed = []
            if st.state in (State.APPLIED, State.OVERRIDDEN):
                reg.engine.set_state(st, State.PENDING, None)


def restore() -> None:
    """Take kvpatch's replacements out of every copy; those the scan registered are forgotten, the others pending."""
    with _lock:
        regs = list(_registered.values())
        for key in [key for key, reg in _registered.items() if reg.scanned]:
            del _registered[key]
    for reg in regs:
        _restore(reg)


def copy_records() -> list[PatchStatus]:
    with _lock:
        held = [
            (reg.engine, st, reg.changes.get(pid, []))
            for reg in _registered.values()
            for pid, st in reg.statuses.items()
        ]
    for engine, st, changes in held:
        reached(engine, st, changes)
    return [st for _, st, _ in held]


def format_copies(copies: list[Copy]) -> str:
    if not copies:
        return "vendored copies: none found (scanned imported modules and installed mlx dependents)"
    lines = [
        f"vendored copies: {len(copies)} (the same code as a patched upstream target; {config.VENDORED}=1 patches them)"
    ]
    width = max(len(c.path) for c in copies)
    lines += [f"  {c.path:<{width}}  = {c.target} [{c.patch_id}]  {c.state}" for c in copies]
    return "\n".join(lines)
