"""The fingerprints a patch was validated on (``kvpatch/data/fingerprints.json``), and live targets' fingerprints,
cached in the verdict file by the defining file's path, size and mtime: a verified environment reads no source."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import surgery, verdicts
from ._warn import emit
from .gate import Action
from .locate import stamp
from .record import Kind

if TYPE_CHECKING:
    from .engine import PatchStatus
    from .record import Patch, Target

SHIPPED = Path(__file__).resolve().parent / "data" / "fingerprints.json"
#: Computed in this process, not yet in the cache: file key -> {line:qualname -> fingerprint}.
_new: dict[str, dict[str, str]] = {}


def fingerprint(obj: Any) -> str | None:
    """A short hash of an object's source (the same on every Python; ``None``: unreadable), looking through kvpatch's
    replacements. A property counts by its setter, else its getter (as ``scripts/record_fingerprints.py`` does)."""
    if isinstance(obj, property):
        obj = obj.fset or obj.fget
    try:
        return fingerprint_source(inspect.getsource(_function(obj)))
    except (OSError, TypeError):
        return None


def _function(obj: Any) -> Any:
    """``obj`` with kvpatch's replacements and a method's binding looked through."""
    func = inspect.unwrap(obj) if callable(obj) else obj
    return getattr(func, "__func__", func)


def fingerprint_source(text: str) -> str:
    """The one normalisation and hash of a definition's source (live, vendored, recorded)."""
    lines = [line.strip() for line in text.splitlines()]
    body = "\n".join(line for line in lines if line and not line.startswith("#"))
    return hashlib.sha256(body.encode()).hexdigest()[:12]


@functools.cache
def shipped() -> dict[str, dict[str, frozenset[str]]]:
    """``kvpatch/data/fingerprints.json`` as patch id -> target path -> fingerprints (read once)."""
    try:
        data = json.loads(SHIPPED.read_text(encoding="utf-8"))["patches"]
        return {pid: {t: frozenset(fps) for t, fps in targets.items()} for pid, targets in data.items()}
    except Exception as exc:  # a broken data file must not break imports (a test guards it)
        emit(f"kvpatch cannot read {SHIPPED}: {exc}")
        return {}


def validated(patch: Patch) -> dict[str, frozenset[str]]:
    """Target path -> fingerprints the patch was validated on."""
    return shipped().get(patch.id, {})


def cached(obj: Any) -> str | None:
    """:func:`fingerprint` of ``obj``, cached by the defining file's path, size and mtime."""
    func = _function(obj)
    code = getattr(func, "__code__", None)
    size_mtime = stamp(getattr(code, "co_filename", None))
    if code is None or size_mtime is None:
        return fingerprint(obj)
    file_key = f"{code.co_filename}|{size_mtime[0]}|{size_mtime[1]}"
    sub = f"{code.co_firstlineno}:{getattr(func, '__qualname__', '?')}"
    known = verdicts.tables()["fingerprints"].get(file_key)
    if isinstance(known, dict) and isinstance(known.get(sub), str):
        return str(known[sub])
    value = _new.get(file_key, {}).get(sub) or fingerprint(obj)
    if value is not None:
        _new.setdefault(file_key, {})[sub] = value
    return value


def save(*, wait: bool = False) -> None:
    """Write the fingerprints computed in this process to the cache (best effort; never waits by default)."""
    if not _new:
        return
    new = {k: dict(v) for k, v in _new.items()}

    def change(data: dict[str, Any]) -> None:
        for file_key, subs in new.items():
            entry = data["fingerprints"].get(file_key)
            data["fingerprints"][file_key] = {**(entry if isinstance(entry, dict) else {}), **subs, "at": time.time()}

    if verdicts.update(change, wait=wait) is None:
        _new.clear()


def check_drift(st: PatchStatus, original_of: Callable[[Target, types.ModuleType], Any]) -> None:
    """Note each imported replaced target of ``st``'s patch whose fingerprint is none it was validated on
    (``st.drift``), and each that is another library's replacement not reaching upstream's code (``st.foreign``): its
    verdict then decides the patch. ``original_of(target, module)``: the upstream object there (``MISSING``: none)."""
    patch = st.record
    known = validated(patch) if st.decision.action is not Action.VERIFY else None
    for target in patch.targets if known else ():
        recorded = known.get(target.path) if known else None
        module = sys.modules.get(target.module)
        if target.kind is not Kind.REPLACE or target in st.fingerprinted or not recorded or module is None:
            continue
        original = original_of(target, module)
        if original is surgery.MISSING:
            continue
        st.fingerprinted.add(target)
        fp = cached(original)
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
        if inner is not None and cached(inner) in recorded:
            continue  # another library's wrapper around upstream code kvpatch validated
        # a replacement not reaching upstream's code: no verdict (measured on upstream's code) vouches for it
        st.foreign.append(target.path)
        st.drift.append(
            f"{target.path} is {where}, another library's replacement of {patch.distribution}'s "
            "code (installed before kvpatch and not calling upstream's)"
        )
    if known:
        save()
