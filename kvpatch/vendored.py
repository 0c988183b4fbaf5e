"""Vendored copies of patched upstream code: found on demand, patched only when asked.

Servers copy upstream files into their own packages (Rapid-MLX 0.16.10 ships
``rapid_mlx/models/mlx_vlm_vendored/cache.py``, mlx-vlm 0.7.2's cache module with three hunks of its
own). Such a copy carries the same bugs kvpatch fixes in ``mlx_vlm.models.cache``, but kvpatch patches
upstream's classes only: ``status`` says the fix is applied while the server runs the unpatched copy.

:func:`scan` finds them. For every replaced target of a patch, the source fingerprint of the *upstream*
code (:func:`kvpatch.engine.fingerprint`'s normalisation, computed from the upstream file's text, so
neither kvpatch's replacement nor anybody else's wrapper is looked at) is compared with every function of
the same name in the source files of modules already imported outside ``mlx_lm`` / ``mlx_vlm`` /
``kvpatch`` and the standard library. Cheap: a file is parsed only when its text contains ``def <name>``
for a target's name (about 0.1 s for the ~1,500 modules a server imports), and nothing is imported or
executed. Equal fingerprints mean the copy's code is the code the patch's decision was taken on.

``KVPATCH_VENDORED=1`` (opt-in) patches the copies with the same fix: a patch's builders are deltas
that receive the original, so the vendored original goes in and the replacement goes onto the vendored
owner. Only patches applied to the installed upstream in this process are used (same code, same
decision), only where the copy's fingerprint equals the installed upstream's, and never over an
attribute someone else replaced after import. :func:`apply` does it for the modules imported so far;
``KVPATCH_VENDORED=1`` also hooks the copies kvpatch knows of (:data:`KNOWN`) and
``KVPATCH_VENDORED=module,module`` hooks the named modules, so they are patched as they are imported.
:func:`restore` (also run by ``kvpatch.deactivate()``) takes the replacements out where they are still
kvpatch's. A builder that inspects upstream's own classes (not the original it receives) declines or
gates on upstream's state as it does there; such a target stays unpatched in the copy, and says so.
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
import threading
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import config, surgery
from ._warn import emit
from .engine import fingerprint, fingerprint_source, hook_registry
from .record import DISTRIBUTIONS, Kind, Patch, Target

if TYPE_CHECKING:
    from .engine import Engine, PatchStatus

__all__ = [
    "KNOWN",
    "VARIABLE",
    "Copy",
    "apply",
    "copy_records",
    "format_copies",
    "hook",
    "register_copy",
    "restore",
    "scan",
    "setting",
    "target_fingerprint",
]

log = logging.getLogger(__name__)

#: The environment variable: ``1`` patches copies (and hooks :data:`KNOWN`); a comma-separated list of
#: module names hooks those modules too. Unset, ``0`` or ``off``: copies are only reported.
VARIABLE = config.VENDORED
#: Modules known to hold vendored copies of patched upstream code (hooked when KVPATCH_VENDORED=1).
KNOWN: tuple[str, ...] = ("rapid_mlx.models.mlx_vlm_vendored.cache",)
_OFF = frozenset({"", "0", "off", "false", "no"})
_ON = frozenset({"1", "on", "true", "yes", "all"})
_SKIP_TOP = frozenset({*DISTRIBUTIONS.values(), "kvpatch", "_kvpatch_boot", "kvpatch_pytest"})
_MISSING = object()
#: Same code under another qualified name counts only when it has at least this many lines.
MIN_LINES = 4
OTHER_OWNER = "found (other owner: not patched)"


@dataclass
class Copy:
    """One vendored copy of one patched upstream target."""

    patch_id: str
    target: str  # the upstream target, "module.Qual.name"
    module: str  # the module holding the copy
    qualname: str  # the copy's qualified name inside it
    fingerprint: str
    #: "found" (reported only), "patched", or "not patched: <why>".
    state: str = "found"

    @property
    def path(self) -> str:
        return f"{self.module}.{self.qualname}"

    def as_dict(self) -> dict[str, str]:
        return {
            "patch": self.patch_id,
            "target": self.target,
            "copy": self.path,
            "fingerprint": self.fingerprint,
            "state": self.state,
        }


@dataclass
class _Installed:
    copy: Copy
    #: How to put the copy's original back.
    change: surgery.Change


@dataclass
class _Registered:
    """A copy a server registered in code (:func:`register_copy`): one status per patch, and its changes."""

    module: str
    of: str
    version: str
    statuses: dict[str, PatchStatus] = field(default_factory=dict)
    changes: dict[str, list[surgery.Change]] = field(default_factory=dict)


@dataclass
class _State:
    lock: threading.RLock = field(default_factory=threading.RLock)
    installed: list[_Installed] = field(default_factory=list)
    hooked: set[str] = field(default_factory=set)
    #: The last state :func:`apply` gave each (patch id, copy path) that it did not patch.
    notes: dict[tuple[str, str], str] = field(default_factory=dict)
    #: Copies registered in code, by module name.
    registered: dict[str, _Registered] = field(default_factory=dict)


_state = _State()


def setting(environ: Mapping[str, str] | None = None) -> tuple[bool, tuple[str, ...]]:
    """(patch copies?, modules to hook) from ``KVPATCH_VENDORED``."""
    raw = config.vendored(environ)
    if raw.lower() in _OFF:
        return False, ()
    if raw.lower() in _ON:
        return True, KNOWN
    names = tuple(n.strip() for n in raw.split(",") if n.strip() and n.strip().lower() not in _ON)
    return True, tuple(dict.fromkeys([*KNOWN, *names]))


# -- fingerprints from source text ----------------------------------------------------------------
def _definitions(source: str, names: frozenset[str]) -> dict[str, tuple[str, str, int]]:
    """``{qualname: (fingerprint, first line, lines)}`` of every function named in ``names`` defined in
    ``source`` at module level or inside classes (any depth), found by indentation, not by parsing: a
    third of the time of ``ast.parse`` on the large cache modules, with the same block ``inspect.getsource``
    gives for ordinary code (a block it reads differently only misses a copy, it never invents one)."""
    if not names:
        return {}
    pattern = re.compile(
        r"^([ \t]*)(?:async[ \t]+)?def[ \t]+(" + "|".join(sorted(map(re.escape, names))) + r")[ \t]*\(", re.M
    )
    lines = source.split("\n")
    found: dict[str, tuple[str, str, int]] = {}
    row, position = 0, 0
    for match in pattern.finditer(source):
        row += source.count("\n", position, match.start())
        position = match.start()
        indent = len(match.group(1).expandtabs())
        qualname = _enclosing(lines, row, indent, match.group(2))
        if qualname is None:
            continue
        first = row
        while first > 0 and lines[first - 1].strip().startswith("@"):
            first -= 1
        end = row + 1
        last = row
        while end < len(lines):
            text = lines[end]
            if text.strip():
                if len(text) - len(text.lstrip()) <= indent and not text.lstrip().startswith(("#", ")")):
                    break
                last = end
            end += 1
        block = "\n".join(lines[first : last + 1])
        kept = [line.strip() for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]
        found[qualname] = (fingerprint_source(block), kept[0], len(kept))
    return found


def _enclosing(lines: list[str], row: int, indent: int, name: str) -> str | None:
    """The qualified name of a ``def`` at ``row``: its enclosing classes, or None inside a function."""
    parts = [name]
    for index in range(row - 1, -1, -1):
        if indent == 0:
            break
        text = lines[index]
        stripped = text.lstrip()
        if not stripped or stripped.startswith(("#", "@", ")")):
            continue
        level = len(text) - len(stripped)
        if level >= indent:
            continue
        header = re.match(r"(class|def|async[ \t]+def)[ \t]+(\w+)", stripped)
        if header is None:
            if stripped.startswith(('"', "'")) or text[:1].isspace():
                continue  # a continuation line or a string inside something
            return None  # module-level code (if/try) holding the def: not a stable name
        if header.group(1) != "class":
            return None  # a function inside a function
        parts.append(header.group(2))
        indent = level
    return ".".join(reversed(parts))


def target_fingerprint(target: Target) -> str | None:
    """The fingerprint of ``target``'s code in the installed upstream file (no import, whatever is
    patched): equal to :func:`kvpatch.engine.fingerprint` of the unpatched object."""
    path = _module_file(target.module)
    source = _read(path) if path is not None else None
    if not source:
        return None
    found = _definitions(source, frozenset([target.attribute])).get(target.qualname)
    return found[0] if found else None


def _module_file(name: str) -> Path | None:
    """The ``.py`` file of module ``name``, without importing it (or any package above it)."""
    module = sys.modules.get(name)
    origin = getattr(module, "__file__", None) if module is not None else None
    if origin is None:
        top, *rest = name.split(".")
        try:
            spec = find_spec(top)  # a top-level name: finds, never imports
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        if not rest:
            origin = spec.origin
        else:
            for base in spec.submodule_search_locations or ():
                stem = Path(base, *rest)
                for candidate in (stem.with_suffix(".py"), stem / "__init__.py"):
                    if candidate.is_file():
                        return candidate
            return None
    if not origin or not origin.endswith(".py"):
        return None
    path = Path(origin)
    return path if path.is_file() else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class _Upstream:
    patch_id: str
    target: Target
    first_line: str  # the normalised first line (``def ...`` or a decorator): the cheap pre-filter
    size: int  # normalised lines


def _applicable(engine: Engine) -> set[str]:
    """Patches that apply to the installed upstream here: applied, or decided to apply and waiting for
    their module (a vendored copy may be imported before upstream's own module)."""
    out = set()
    for pid, st in engine.status.items():
        if st.state.value == "applied" or st.installed:
            out.add(pid)
        elif st.decision.action.value == "apply" and st.state.value in ("pending", "overridden"):
            out.add(pid)
    return out


def _upstream_fingerprints(engine: Engine) -> dict[str, list[_Upstream]]:
    """``{fingerprint: [upstream target]}`` of every replaced target of a patch that applies here, read
    from the installed upstream files (the release's own code, whatever is patched in this process)."""
    applicable = _applicable(engine)
    out: dict[str, list[_Upstream]] = {}
    texts: dict[str, dict[str, tuple[str, str, int]]] = {}
    patches = engine.materialise()
    for patch in patches:
        if patch.id not in applicable:
            continue
        for target in patch.targets:
            if target.kind is not Kind.REPLACE:
                continue
            if target.module not in texts:
                path = _module_file(target.module)
                source = _read(path) if path is not None else None
                wanted = frozenset(t.attribute for p in patches for t in p.targets if t.module == target.module)
                texts[target.module] = _definitions(source, wanted) if source else {}
            found = texts[target.module].get(target.qualname)
            if found is not None:
                fp, first, size = found
                out.setdefault(fp, []).append(_Upstream(patch.id, target, first, size))
    return out


def _candidate_modules(modules: Iterable[str] | None) -> list[tuple[str, Path]]:
    stdlib: frozenset[str] = getattr(sys, "stdlib_module_names", frozenset())
    names = list(sys.modules) if modules is None else list(modules)
    out = []
    for name in names:
        top = name.split(".")[0]
        if top in _SKIP_TOP or top in stdlib or name == "__main__":
            continue
        path = _module_file(name)
        if path is not None:
            out.append((name, path))
    return out


_DEPENDS = re.compile(r"^(mlx|mlx[-_]lm|mlx[-_]vlm)\b", re.I)


def _installed_dependents() -> list[tuple[str, Path]]:
    """``(module name, file)`` of every ``.py`` file of an installed distribution that requires mlx,
    mlx-lm or mlx-vlm (the only code that can hold a copy that matters: downstream servers), read from
    the distributions' RECORD files without importing anything."""
    import importlib.metadata as metadata

    out: list[tuple[str, Path]] = []
    seen: set[str] = set()
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if not name or name in seen or name in ("mlx", "mlx-lm", "mlx-vlm", "mlx-cpu", "mlx-metal", "kvpatch"):
            continue
        seen.add(name)
        if not any(_DEPENDS.match(req) for req in dist.requires or ()):
            continue
        for file in dist.files or ():
            if file.suffix != ".py" or ".." in file.parts:
                continue
            parts = list(file.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if not parts or not all(p.isidentifier() for p in parts):
                continue
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                out.append((".".join(parts), path))
    return out


def scan(engine: Engine | None = None, *, modules: Iterable[str] | None = None, installed: bool = False) -> list[Copy]:
    """Vendored copies of the targets of patches that apply here, among ``modules`` (default: every
    imported module outside mlx_lm / mlx_vlm / kvpatch and the standard library) and, with ``installed``,
    the files of every installed distribution that requires mlx / mlx-lm / mlx-vlm (what ``kvpatch
    status --scan`` looks at: a fresh CLI process has imported no server). Reads source files only.

    A copy is a function whose fingerprint equals an upstream target's and whose qualified name is the
    target's (same class, same method). The same code under another name (a subclass that copied a
    method) is reported too, when it is more than a few lines, with state "found (other owner)": such
    code has the bug as well, but it is not patched.
    """
    if engine is None:
        from . import get_engine

        engine = get_engine()
    upstream = _upstream_fingerprints(engine)
    if not upstream:
        return []
    names = frozenset(u.target.attribute for entries in upstream.values() for u in entries)
    needles = re.compile("|".join(sorted(re.escape(u.first_line) for entries in upstream.values() for u in entries)))
    found: list[Copy] = []
    with _state.lock:
        patched = dict(_state.notes)
        patched.update({(i.copy.patch_id, i.copy.path): i.copy.state for i in _state.installed})
    candidates = dict(_candidate_modules(modules))
    if installed:
        for module, path in _installed_dependents():
            candidates.setdefault(module, path)
    for module, path in candidates.items():
        source = _read(path)
        if not source or needles.search(source) is None:
            continue
        for qualname, (fp, _, size) in _definitions(source, names).items():
            for entry in upstream.get(fp, []):
                if qualname.rsplit(".", 1)[-1] != entry.target.attribute:
                    continue
                same_name = qualname == entry.target.qualname
                if not same_name and size < MIN_LINES:
                    continue  # a trivial body (``return True``) says nothing about where it came from
                copy = Copy(entry.patch_id, entry.target.path, module, qualname, fp)
                copy.state = patched.get((entry.patch_id, copy.path), "found" if same_name else OTHER_OWNER)
                found.append(copy)
    return found


# -- patching copies (KVPATCH_VENDORED=1) ----------------------------------------------------------
def _install(engine: Engine, copy: Copy) -> None:
    """Patch one copy found by :func:`scan` (``KVPATCH_VENDORED``), through :func:`_install_in_copy`."""
    patch = engine.status[copy.patch_id].record
    target = next(t for t in patch.targets if t.path == copy.target)
    done = _install_in_copy(patch, target, copy.module, recorded=False)
    if isinstance(done, str):
        copy.state = f"not patched: {done.partition(': ')[2]}"
        return
    if done is not None:
        _state.installed.append(_Installed(copy, done))
    copy.state = "patched"


def apply(engine: Engine | None = None, *, modules: Iterable[str] | None = None, force: bool = False) -> list[Copy]:
    """Patch the vendored copies found among ``modules`` (default: all imported) with the fixes applied to
    the installed upstream. Does nothing unless ``KVPATCH_VENDORED`` is on or ``force``. Idempotent;
    never raises (a copy that cannot be patched says why in its ``state``). Returns the copies."""
    on, _ = setting()
    if not (on or force):
        return []
    try:
        if engine is None:
            from . import get_engine

            engine = get_engine()
        copies = scan(engine, modules=modules)
        applied = _applicable(engine)
        with _state.lock:
            done = {(i.copy.patch_id, i.copy.path) for i in _state.installed}
            for copy in copies:
                if copy.state == OTHER_OWNER:
                    continue
                if (copy.patch_id, copy.path) in done:
                    copy.state = "patched"
                    continue
                if copy.patch_id not in applied:
                    copy.state = f"not patched: {copy.patch_id} is not applied to the installed upstream here"
                    continue
                try:
                    _install(engine, copy)  # stacks on a copy kvpatch patched already (engine order)
                except Exception as exc:
                    copy.state = f"not patched: {type(exc).__name__}: {exc}"
                    emit(f"kvpatch: vendored copy {copy.path} {copy.state}", key=f"vendored:{copy.path}")
                if copy.state != "patched":
                    _state.notes[(copy.patch_id, copy.path)] = copy.state
        return copies
    except Exception as exc:  # kvpatch never raises into its host
        emit(f"kvpatch: patching vendored copies failed: {type(exc).__name__}: {exc}")
        return []


def restore() -> list[str]:
    """Take kvpatch's replacements out of vendored copies where they are still in place; returns the paths
    restored. A replacement someone wrapped since is left (with the wrapper) and warned about."""
    from .engine import State, set_state

    restored = []
    with _state.lock:
        for reg in _state.registered.values():
            for pid, changes in reg.changes.items():
                for change in reversed(changes):
                    note = surgery.restore(change)
                    if note:
                        emit(f"kvpatch: vendored copy: {note}")
                    else:
                        restored.append(change.target.path)
                st = reg.statuses[pid]
                st.installed = []
                if st.state in (State.APPLIED, State.OVERRIDDEN):
                    set_state(st, State.PENDING, st.decision.reason)
            reg.changes.clear()
        for item in reversed(_state.installed):
            note = surgery.restore(item.change)
            if note:
                emit(f"kvpatch: vendored copy: {note}")
                continue
            item.copy.state = "found"
            restored.append(item.copy.path)
        _state.installed.clear()
        _state.notes.clear()
    return restored


# -- copies registered in code (kvpatch.register_copy) ----------------------------------------------------
def register_copy(
    engine: Engine, module: str, *, of: str, version: str, patches: Iterable[str] | None = None
) -> list[PatchStatus]:
    """Declare ``module`` a copy of ``of`` (an mlx-lm / mlx-vlm module) as released in ``version`` of its
    distribution, and patch it with the patches (all, or the ids in ``patches``) that the gate applies to that
    release and that change ``of``. Each gets a status of its own (``copy`` = ``module``), apart from
    upstream's: applied only while its replacements are in the copy. The copy is patched when it is imported
    (now, if it is imported already). Returns the copy's statuses; never raises for a patch that cannot be
    used (an unknown or retired id is a status ``failed`` saying so)."""
    from .detect import Upstream
    from .engine import _FROM_ACTION, PatchStatus, State
    from .gate import Action, Decision, decide

    top = of.split(".", 1)[0]
    dist = next((d for d, name in DISTRIBUTIONS.items() if name == top), None)
    if dist is None:
        raise ValueError(f"{of} is not a module of {' or '.join(DISTRIBUTIONS)}")
    wanted = None if patches is None else list(dict.fromkeys(patches))
    reg = _Registered(module, of, version)
    known = {p.id: p for p in engine.materialise()}
    for patch in known.values():
        if patch.distribution != dist or of not in patch.modules or (wanted is not None and patch.id not in wanted):
            continue
        decision = decide(patch, Upstream(dist, version), engine.config)
        state = _FROM_ACTION[decision.action]
        reason = f"copy of {dist} {version}'s {of}: {decision.reason}"
        if decision.action is Action.VERIFY:
            state = State.UNVERIFIED
            reason += "; the reproduction runs on the installed upstream, not on a copy: not applied"
        reg.statuses[patch.id] = PatchStatus(patch, decision, state, reason, copy=module)
    for pid in wanted or ():
        if pid not in reg.statuses:
            why = "no such patch" if pid not in known else f"it does not change {of}"
            st = PatchStatus(known[pid] if pid in known else _unknown(pid, dist), Decision(Action.DISABLED, why),
                             State.FAILED, f"{pid} cannot patch {module}: {why}", error=why, copy=module)  # fmt: skip
            reg.statuses[pid] = st
    with _state.lock:
        _state.registered[module] = reg
    register = hook_registry()
    if isinstance(register, BaseException):
        raise register
    register(lambda loaded: _patch_registered(reg), module)
    return list(reg.statuses.values())


def _unknown(pid: str, dist: str) -> Any:
    """A record standing for a patch id kvpatch does not know (retired, or misspelt)."""
    from .record import Expiry, Patch

    return Patch(pid, "unknown patch", dist, "<0", "", Expiry("unknown"), fixed_in="0")


def _patch_registered(reg: _Registered) -> None:
    """Install, on the imported copy, every patch of ``reg`` the gate applies (all or nothing per patch)."""
    from .engine import State, TargetMissing, set_state

    for pid, st in reg.statuses.items():
        if st.state is not State.PENDING:
            continue
        done: list[surgery.Change] = []
        try:
            for target in st.record.targets:
                if target.module != reg.of:
                    continue  # the patch's other modules are upstream's own
                change = _install_in_copy(st.record, target, reg.module, recorded=True)
                if isinstance(change, str):
                    raise TargetMissing(change) if change.startswith("missing") else _Declined(change)
                if change is not None:
                    done.append(change)
        except Exception as exc:
            for change in reversed(done):
                surgery.restore(change)
            if isinstance(exc, _Declined) and str(exc).startswith(("drifted", "replaced")):
                set_state(st, State.DRIFTED, f"{st.reason}; {exc}: not applied")
            elif isinstance(exc, _Declined):
                set_state(st, State.NOT_NEEDED, f"{st.reason}; {exc}")
            else:
                failed = State.TARGET_MISSING if isinstance(exc, TargetMissing) else State.FAILED
                set_state(st, failed, f"{st.reason}; not applied: {type(exc).__name__}: {exc}", error=str(exc))
            continue
        with _state.lock:
            reg.changes[pid] = done
            st.installed = [c.target for c in done]
            set_state(st, State.APPLIED if done else State.NOT_NEEDED)


class _Declined(Exception):
    """The copy keeps its code for this patch (the builder declined, or the copy's code is not upstream's)."""


def _install_in_copy(patch: Patch, target: Target, module: str, *, recorded: bool) -> surgery.Change | str | None:
    """Put ``target``'s fix on the copy's object of the same qualified name in ``module``, through kvpatch's one
    install step (:func:`kvpatch.surgery.prepare` and :func:`~kvpatch.surgery.commit`: the replacement carries
    the original's metadata and kvpatch's mark; restore puts back only what is still kvpatch's).

    Returns the change; ``None`` when there is nothing to do (the fix is there already, or an optional target
    the copy lacks); or why not, as ``"<missing|declined|drifted|replaced>: <text>"``. ``recorded``: the copy's
    code must be one the patch was validated on (``kvpatch/data/fingerprints.json``).
    """
    owner: Any = sys.modules[module]
    for part in target.owner_path:
        owner = (
            vars(owner).get(part, _MISSING) if isinstance(owner, types.ModuleType) else getattr(owner, part, _MISSING)
        )
        if owner is _MISSING:
            return None if target.optional else f"missing: {module}.{target.qualname} (the copy has no {part})"
    name = target.attribute
    static = inspect.getattr_static(owner, name, _MISSING)
    wrapper = None
    if target.kind is Kind.ADD:
        if static is not _MISSING:
            return None if surgery.carries(static, patch.id) else "declined: the copy has it already"
        original: Any = None
    else:
        if static is _MISSING:
            return None if target.optional else f"missing: {module}.{target.qualname}"
        if surgery.carries(static, patch.id):
            return None
        wrapper = type(static) if isinstance(static, (classmethod, staticmethod)) else None
        original = static.__func__ if wrapper else getattr(owner, name)
        # stacked on another kvpatch replacement of the copy (or an added attribute): the copy's code is under it
        ours = any(surgery.mark_of(node) is not None for node in surgery.chain(static))
        probe: Any = (original.fset or original.fget) if isinstance(original, property) else original
        code = getattr(inspect.unwrap(probe), "__code__", None)
        home = _module_file(module)
        own_code = code is not None and home is not None and Path(code.co_filename).resolve() == home.resolve()
        if not ours and callable(probe) and not own_code:
            # Someone replaced the copy after import: their code is not the copy's. (A plain value, such as a
            # class attribute a patch serves through a property, has no code to compare.)
            return "replaced: the attribute is no longer the copy's own code (replaced after import)"
        if recorded:
            from . import fingerprints

            known = fingerprints.validated(patch).get(target.path)
            if known and fingerprint(original) not in known:
                release = f"{patch.distribution} release the patch was validated on"
                return f"drifted: {module}.{target.qualname} is not the code of any {release}"
    where = Target(module, target.qualname, target.kind, target.optional)
    function = surgery.prepare(patch, where, owner, original, patch.builders[target])
    if function is original:
        return "declined: the patch's builder declined for this copy"
    own = vars(owner)
    had_own = name in own
    return surgery.commit(
        patch.id, where, owner, name, had_own=had_own, raw=own[name] if had_own else surgery.MISSING,
        original=original, function=function, wrapper=wrapper,
    )  # fmt: skip


def copy_records() -> list[PatchStatus]:
    """The statuses of every registered copy's patches, looked up again (``overridden`` when a replacement is
    no longer reachable in the copy)."""
    from .engine import State, set_state

    out: list[PatchStatus] = []
    with _state.lock:
        registered = list(_state.registered.values())
    for reg in registered:
        for pid, st in reg.statuses.items():
            changes = reg.changes.get(pid, [])
            if st.state in (State.APPLIED, State.OVERRIDDEN) and changes:
                gone = [d for s, d in map(surgery.liveness, changes) if s in ("overridden", "removed")]
                if gone:
                    set_state(st, State.OVERRIDDEN, "; ".join(gone))
                elif st.state is State.OVERRIDDEN:
                    set_state(st, State.APPLIED, st.decision.reason)
            out.append(st)
    return out


def hook(engine: Engine, environ: Mapping[str, str] | None = None) -> None:
    """With ``KVPATCH_VENDORED`` on: patch copies in the modules it names (and :data:`KNOWN`) as they are
    imported, and in those already imported. Called when kvpatch activates; never raises."""
    on, names = setting(environ)
    if not on:
        return
    try:
        register = hook_registry()  # kvpatch's own post-import hooks: they run after the module's code, no lock held
        if isinstance(register, BaseException):
            raise register
        for name in names:
            with _state.lock:
                if name in _state.hooked:
                    continue
                _state.hooked.add(name)
            current = sys.modules.get(name)
            if current is not None and getattr(getattr(current, "__spec__", None), "_initializing", False):
                # Activation came from inside this module's own import (it imports upstream): its classes
                # are not defined yet and the registry would call the hook now, never again. Left to apply().
                log.info("kvpatch: %s is still being imported; call kvpatch.vendored.apply()", name)
                continue

            def patch_module(module: types.ModuleType, _engine: Engine = engine) -> None:
                apply(_engine, modules=[module.__name__], force=True)

            register(patch_module, name)
    except Exception as exc:
        emit(f"kvpatch: could not hook vendored modules: {type(exc).__name__}: {exc}")


def format_copies(copies: list[Copy]) -> str:
    """The text ``kvpatch status --scan`` prints."""
    if not copies:
        return "vendored copies: none found (scanned imported modules and installed mlx dependents)"
    lines = [f"vendored copies: {len(copies)} (the same code as a patched upstream target; {VARIABLE}=1 patches them)"]
    width = max(len(c.path) for c in copies)
    for c in copies:
        lines.append(f"  {c.path:<{width}}  = {c.target} [{c.patch_id}]  {c.state}")
    return "\n".join(lines)
