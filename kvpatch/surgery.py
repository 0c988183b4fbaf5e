"""Surgery on someone else's objects: install a replacement (a plain function with the original's metadata and
kvpatch's mark, never twice), tell whether it is still reached, put things back only where kvpatch's replacement is
still the attribute (under a foreign wrapt proxy the original is spliced in; other wrappers stay, reported).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import operator
import sys
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .record import DISTRIBUTIONS, Kind, Patch, Target, borrowed

MISSING: Any = type("_Missing", (), {"__repr__": lambda self: "<missing>"})()
#: Every replacement function kvpatch made, with its patch id (kept across ``importlib.reload``): ``functools.wraps``
#: copies the visible mark (``__kvpatch__``) onto a foreign wrapper, so only this says which functions are kvpatch's.
_OURS: weakref.WeakKeyDictionary[Any, str] = globals().get("_OURS") or weakref.WeakKeyDictionary()
#: The same for replacement properties (they carry no attributes): id -> (property, patch id, the original property
#: or value; None: one added in front of an instance attribute).
_OURS_PROPERTIES: dict[int, tuple[Any, str, Any]] = globals().get("_OURS_PROPERTIES") or {}


@dataclass
class Change:
    patch_id: str
    target: Target
    owner: Any
    name: str
    raw_original: Any  # what the owner's own ``__dict__`` held (``MISSING``: nothing: inherited or absent)
    original: Any  # the plain original function (``None`` for an added attribute)
    function: Any  # the plain replacement (carries the mark)
    spliced_into: Any = None  # the foreign wrapt proxy :func:`restore` put the original in under


def _plain(obj: Any) -> Any:  # type(), not isinstance(): a wrapt proxy reports its wrapped object's class
    return obj.__func__ if type(obj) in (classmethod, staticmethod) else obj


def _property(obj: Any) -> tuple[Any, str, Any] | None:
    entry = _OURS_PROPERTIES.get(id(obj))
    return entry if entry is not None and entry[0] is obj else None


def _walk(obj: Any, closures: bool = True) -> Iterator[tuple[Any, Any]]:
    """What ``obj`` reaches through ``__wrapped__`` (and a kvpatch property's original) and, with ``closures``, the
    functions a closure holds, breadth first, each with the outermost non-kvpatch object above it (None: none)."""
    seen: set[int] = set()
    todo: list[tuple[Any, Any]] = [(_plain(obj), None)]
    while todo and len(seen) < 256:  # more is a cycle or a pathology: stop looking
        current, above = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current, above
        if above is None and mark_of(current) is None:
            above = current
        entry = _property(current)
        with contextlib.suppress(Exception):  # a proxy whose __wrapped__ raises
            todo.append((_plain(entry[2] if entry else getattr(current, "__wrapped__", None)), above))
        cells = current.__closure__ if closures and type(current) is types.FunctionType else None
        for cell in cells or ():
            with contextlib.suppress(ValueError):  # an empty cell
                if callable(cell.cell_contents):
                    todo.append((_plain(cell.cell_contents), above))


def reachable(obj: Any, closures: bool = True) -> Iterator[Any]:
    return (node for node, _ in _walk(obj, closures))


def carries(obj: Any, patch_id: str) -> bool:
    return any(mark_of(node) == patch_id for node in reachable(obj))


def mark_of(obj: Any) -> str | None:  # only a plain function: a proxy forwards attribute reads to what it wraps
    entry = _property(obj)
    if entry is not None:
        return entry[1]
    return _OURS.get(obj) if type(obj) is types.FunctionType else None


def describe(obj: Any) -> str:
    obj = _plain(obj)
    try:
        module = getattr(obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    except Exception:
        module = qualname = None
    if isinstance(module, str) and isinstance(qualname, str):
        return f"{module}.{qualname}"
    return f"<{type(obj).__module__}.{type(obj).__qualname__} object>"


def foreign(obj: Any, package: str) -> str | None:
    """Whose code ``obj`` is (another library's function, or a wrapper's type); None: a function of ``package``."""
    func = _plain(obj)
    if type(func) is types.FunctionType:
        module = func.__module__ or ""
        return None if f"{module}.".startswith(f"{package}.") else f"{module}.{func.__qualname__}"
    owner = getattr(func, "__objclass__", None)
    if (
        isinstance(func, (types.MethodDescriptorType, types.WrapperDescriptorType, types.ClassMethodDescriptorType))
        and getattr(owner, "__module__", "") == "builtins"
    ):
        return None  # a method a class inherits from ``object`` (``__reduce_ex__``): no library's code
    kind = type(func)
    inner = getattr(func, "__wrapped__", None)
    wraps = f" around {getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', '?')}" if inner else ""
    return f"{kind.__module__}.{kind.__qualname__}{wraps}"


def upstream_inner(obj: Any, package: str) -> Any:
    """The first function behind ``obj`` (a wrapper) that is ``package``'s own code, not kvpatch's; ``None``: none."""
    plain = (n for n in reachable(obj) if type(n) is types.FunctionType and mark_of(n) is None)
    return next((n for n in plain if foreign(n, package) is None), None)


def owner_of(target: Target, module: types.ModuleType) -> Any:
    owner: Any = module
    for part in target.owner_path:
        owner = getattr(owner, part, MISSING)
        if owner is MISSING:
            break
    return owner


def foreign_targets(patch: Patch) -> list[str]:
    """``"<target>: <qualified name>"`` for each imported replaced target of ``patch`` that is :func:`foreign`."""
    found = []
    for target in (t for t in patch.targets if t.kind is Kind.REPLACE and sys.modules.get(t.module) is not None):
        live = inspect.getattr_static(owner_of(target, sys.modules[target.module]), target.attribute, MISSING)
        who = foreign(live, patch.import_name) if live is not MISSING else None
        if who is not None:
            found.append(f"{target.path}: {who}")
    return found


def build(patch: Patch, owner: Any, original: Any, builder: Callable[[Any], Any]) -> Any:
    """``builder(original)``, or ``original`` for another distribution's class (:attr:`Patch.own_classes_only`)."""
    if patch.own_classes_only and borrowed(owner, patch.import_name):
        return original
    return builder(original)


def mark(patch: Patch, target: Target, owner: Any, original: Any, function: Any) -> Any:
    """Give a built replacement the original's identity (added: the name it would have had) and kvpatch's mark."""
    if isinstance(function, property) and (
        isinstance(original, property) or (isinstance(owner, type) and (original is None or not callable(original)))
    ):
        # a property for a property, in front of an instance attribute, or serving a class attribute's plain value
        _OURS_PROPERTIES[id(function)] = (function, patch.id, original)
        return function
    if type(function) is not types.FunctionType:
        raise TypeError(f"{patch.id}: builder for {target.path} returned {function!r}, not a plain function")
    if original is not None:
        functools.update_wrapper(function, original)
    else:
        is_module = isinstance(owner, types.ModuleType)
        function.__name__ = target.attribute
        function.__qualname__ = target.attribute if is_module else f"{owner.__qualname__}.{target.attribute}"
        function.__module__ = owner.__name__ if is_module else owner.__module__
    function.__kvpatch__ = patch.id  # type: ignore[attr-defined]
    _OURS[function] = patch.id
    return function


class TargetMissing(LookupError):
    pass


def install(
    patch: Patch,
    target: Target,
    owner: Any,
    *,
    at: Target | None = None,
    make: Callable[[Any], Any] | None = None,
    check: Callable[[Any], None] | None = None,
    lock: contextlib.AbstractContextManager[Any] | None = None,
    record: Callable[[Change], None] | None = None,
    under: Any = None,
) -> Change | None:
    """Install ``target``'s replacement on ``owner`` (a vendored copy's: recorded as ``at``); ``None``: nothing to do.
    The attribute is read again under ``lock`` before it is set (``record(change)`` runs there): changed, rebuilt.
    ``under``: the foreign wrapt proxy that is the attribute, which a restore spliced the original in under: the
    replacement goes in under it, on top of what it wraps now (the original, or a patch below on the attribute)."""
    at = at or target
    name = target.attribute
    if owner is MISSING:
        if target.optional:
            return None
        raise TargetMissing(f"{at.path}: {'.'.join(target.owner_path)} not found in {at.module}")
    for _attempt in range(3):
        raw = vars(owner).get(name, MISSING)
        present = inspect.getattr_static(owner, name, MISSING)
        if present is not MISSING and carries(present, patch.id):
            return None
        wrapper = type(present) if under is None and isinstance(present, (classmethod, staticmethod)) else None
        if target.kind is Kind.ADD:
            if present is not MISSING:
                raise TargetMissing(
                    f"{at.path} already exists upstream: either upstream fixed it (retire this patch) "
                    "or it moved (retarget it)"
                )
            original = None
        elif present is MISSING:
            if target.optional:
                return None
            raise TargetMissing(f"{at.path} not found (moved or removed upstream?)")
        else:
            held = _plain(under.__wrapped__) if under is not None else None
            original = held or (present.__func__ if wrapper else getattr(owner, name))
            if check is not None:
                check(original)
        built = make(original) if make is not None else build(patch, owner, original, patch.builders[target])
        if built is original:
            return None
        function = mark(patch, at, owner, original, built)
        with lock if lock is not None else contextlib.nullcontext():
            if under is not None:  # the proxy stays the attribute
                if not splice_under(under, original, function):
                    return None
                raw = original
            elif vars(owner).get(name, MISSING) is not raw:
                continue  # someone changed the attribute while it was built: look again
            else:
                setattr(owner, name, wrapper(function) if wrapper is not None else function)
            change = Change(patch.id, at, owner, name, raw, original, function)
            if record is not None:
                record(change)
        return change
    raise RuntimeError(f"{at.path} kept changing while kvpatch installed {patch.id}")


def liveness(change: Change) -> tuple[str, str]:
    """``("in place" | "wrapped" | "overridden" | "removed", detail)`` of ``change``'s replacement now."""
    current = inspect.getattr_static(change.owner, change.name, MISSING)
    if current is MISSING:
        return "removed", f"{change.target.path} no longer exists"
    above = next((above for node, above in _walk(current) if node is change.function), MISSING)
    if above is MISSING:
        return "overridden", f"overridden by {describe(current)}"
    return ("in place", "") if above is None else ("wrapped", f"under {describe(above)}")


def restore(change: Change) -> str | None:
    """Undo ``change`` where kvpatch's replacement is still its own; else a note of what was left in place, and why."""
    state, detail = liveness(change)
    note: str | None = None
    if state == "in place":
        if change.raw_original is not MISSING:
            setattr(change.owner, change.name, change.raw_original)
        else:
            with contextlib.suppress(AttributeError):  # someone else removed it
                delattr(change.owner, change.name)
    elif state == "wrapped":
        current = inspect.getattr_static(change.owner, change.name, MISSING)
        wrapt = sys.modules.get("wrapt")
        # wrapt 2's function wrappers derive from BaseObjectProxy (ObjectProxy's base); wrapt 1 has ObjectProxy only
        proxy = getattr(wrapt, "BaseObjectProxy", None) or getattr(wrapt, "ObjectProxy", None)
        proxies = [p for p in reachable(current, closures=False) if proxy and isinstance(p, proxy)]
        change.spliced_into = next((p for p in proxies if splice_under(p, change.function, change.original)), None)
        if change.spliced_into is None:
            note = (
                f"{change.target.path}: left {describe(current)} in place; it wraps kvpatch's replacement in a way "
                "that cannot be changed from outside (a closure), so the fix stays active underneath it"
            )
    elif state == "overridden":
        note = f"{change.target.path}: left in place ({detail}); kvpatch's replacement was no longer reachable"
    if isinstance(change.owner, types.ModuleType) and change.original is not None:
        rebind_aliases(change.function, change.original, skip=change.owner, everywhere=True)
    return note


def splice_under(proxy: Any, old: Any, new: Any) -> bool:
    """Replace ``old`` by ``new`` as what the wrapt ``proxy`` wraps (as a classmethod or staticmethod where ``old``
    was one); True if it now wraps ``new``."""
    try:
        current = proxy.__wrapped__
        if _plain(current) is not old:
            return False
        proxy.__wrapped__ = type(current)(new) if type(current) in (classmethod, staticmethod) else new
        return _plain(proxy.__wrapped__) is new
    except Exception:  # a proxy whose __wrapped__ raises or cannot be set
        return False


def rebind_aliases(old: Any, new: Any, *, skip: types.ModuleType, everywhere: bool = False) -> None:
    """Rebind module attributes that are ``old`` to ``new`` in the upstream packages (or ``everywhere``)."""
    packages = frozenset(DISTRIBUTIONS.values())
    for mod_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)  # None: a module stand-in without one
        if module is skip or not isinstance(namespace, dict) or not (everywhere or mod_name.split(".")[0] in packages):
            continue
        with contextlib.suppress(RuntimeError):  # the namespace changed size meanwhile (no GIL): look one by one
            if not any(map(operator.is_, namespace.values(), itertools.repeat(old))):
                continue  # the usual case, tested at C speed (a late activation scans every module)
        for name, value in list(namespace.items()):
            if value is old:
                with contextlib.suppress(Exception):  # a read-only module stand-in
                    setattr(module, name, new)
