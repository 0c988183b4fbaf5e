"""kvpatch: version-gated, audited fixes for known KV-cache bugs in mlx-lm and mlx-vlm.

Importing kvpatch (or mlx-lm / mlx-vlm, through a ``.pth`` bootstrap) activates it: every patch whose upstream
release or pinned commit has the bug is installed when its target module is imported. ``KVPATCH=off`` turns it
off; ``python -m kvpatch status`` shows what is applied and why."""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Iterable

from . import config
from ._warn import emit as _emit
from ._warn import failure as _failure
from .engine import Engine, KvpatchWarning, PatchStatus
from .fingerprints import fingerprint
from .record import Expiry, Finding, Kind, Patch, Target
from .states import State

#: The server API loaded on first use (``__getattr__``): name -> module.
_LAZY = {"bounded_prompt_cache": "bounding"}
__all__ = [
    "Engine",
    "Expiry",
    "Finding",
    "Kind",
    "KvpatchWarning",
    "Patch",
    "PatchStatus",
    "State",
    "Target",
    "__version__",
    "activate",
    "deactivate",
    "fingerprint",
    "get_engine",
    "records",
    "register_copy",
    "NotApplied",
    "require_applied",
    "NotFixed",
    "UnknownPatch",
    "require",
    "is_fixed",
    *_LAZY,
]

__version__ = "0.1.0"

# ``importlib.reload(kvpatch)`` re-runs this file in the same namespace: the process keeps its one engine.
_engine: Engine | None = globals().get("_engine")
if "_lock" not in globals() and hasattr(os, "register_at_fork"):  # a child of os.fork gets a lock no thread holds
    os.register_at_fork(after_in_child=lambda: globals().__setitem__("_lock", threading.Lock()))
_lock = globals().get("_lock") or threading.Lock()


def get_engine() -> Engine:
    """The process's engine (built on first use; not necessarily active)."""
    global _engine
    if _engine is None:
        from . import registry

        # Built outside the lock: building imports patch units.
        stubs = registry.index()
        patches, broken = (stubs, {}) if stubs is not None else registry.load()
        built = Engine(patches, broken=broken)
        with _lock:
            if _engine is None:
                _engine = built
    return _engine


def activate() -> Engine | None:
    """Activate kvpatch in this process (idempotent). Never raises; returns ``None`` on failure."""
    try:
        engine = get_engine()
        if engine.config.enabled:
            engine.activate()
            if config.vendored():  # opt-in: patch vendored copies (kvpatch.vendored)
                from . import vendored

                vendored.hook(engine)
        return engine
    except Exception as exc:  # kvpatch must never break the user's program
        _emit(f"kvpatch could not activate: {_failure(exc)}", key="activate")
        return None


def deactivate() -> None:
    """Restore every patched original in this process."""
    if _engine is not None:
        _engine.deactivate()
    vendored = sys.modules.get(f"{__name__}.vendored")
    if vendored is not None:
        vendored.restore()


def records() -> list[PatchStatus]:
    """The status of every patch in this process as it is now (a replacement replaced since shows ``overridden``;
    call this after your own patches are in), then one per registered copy and patch."""
    engine = get_engine()
    engine.materialise()
    engine.refresh()
    # every patch: one whose unit can no longer be loaded (kvpatch uninstalled meanwhile) keeps its decided state
    return [engine.status[p.id] for p in list(engine.patches)] + _copy_records()


def _copy_records() -> list[PatchStatus]:
    vendored = sys.modules.get(f"{__name__}.vendored")  # no copy registered: not even loaded
    return vendored.copy_records() if vendored is not None else []


def register_copy(module: str, *, of: str, version: str, patches: Iterable[str] | None = None) -> list[PatchStatus]:
    """Declare ``module`` a vendored copy of upstream's ``of`` as released in ``version`` (e.g.
    ``register_copy("rapid_mlx.vendor.mlx_vlm_cache", of="mlx_vlm.models.cache", version="0.7.2")``): kvpatch
    patches it with the patches the gate applies to that release (or those named in ``patches``) and reports them
    for the copy (``PatchStatus.copy``). Returns the copy's statuses."""
    for name, value in (("module", module), ("of", of), ("version", version)):
        if not isinstance(value, str):
            raise TypeError(f"register_copy(): {name} must be a str, not {type(value).__name__}")
    if patches is not None:
        if isinstance(patches, (str, bytes)) or not isinstance(patches, Iterable):
            raise TypeError(f"register_copy(): patches must be patch ids (a list), not {type(patches).__name__}")
        patches = list(patches)
        if bad := [p for p in patches if not isinstance(p, str)]:
            raise TypeError(f"register_copy(): patch ids are str, not {type(bad[0]).__name__}")
    from . import vendored

    return vendored.register_copy(get_engine(), module, of=of, version=version, patches=patches)


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'kvpatch' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


def _command_line() -> bool:
    """Whether the command line is importing kvpatch (the ``kvpatch`` script, ``python -m kvpatch``): it activates
    after it has parsed its arguments, for a command that needs it (``--version``, ``help`` and a usage error
    activate nothing)."""
    if getattr(sys.modules.get("_kvpatch_cli"), "starting", False):
        return True
    if sys.argv[:1] != ["-m"]:  # while runpy looks for the module to run, sys.argv[0] is "-m"
        return False
    words = list(getattr(sys, "orig_argv", ()))
    at = next((i for i, word in enumerate(words) if i and word.startswith("-m")), None)
    return at is not None and (words[at][2:] or "".join(words[at + 1 : at + 2])) == __name__


# Loaded with kvpatch, not on first use: a process whose kvpatch is uninstalled meanwhile can still assert.
from .assertions import NotApplied, NotFixed, UnknownPatch, is_fixed, require, require_applied  # noqa: E402

if not _command_line():
    activate()
