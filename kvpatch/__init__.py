"""kvpatch: version-gated, audited fixes for known KV-cache bugs in mlx-lm and mlx-vlm.

Importing kvpatch activates it: every patch whose upstream release (or pinned git commit) has the
bug is installed as soon as its target module is imported, before or after kvpatch. Installed in an
environment, kvpatch also activates itself in any process that imports mlx-lm or mlx-vlm (through a
tiny ``.pth`` bootstrap that costs nothing to processes that never import them).

``KVPATCH=off`` turns it all off; ``KVPATCH_DISABLE=id,id`` (or ``*``) leaves out single patches.
``python -m kvpatch status`` shows what is applied and why.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings

from .engine import Engine, KvpatchWarning, PatchStatus, State, fingerprint
from .record import Expiry, Finding, Kind, Patch, Target

__all__ = [
    "Engine",
    "Expiry",
    "Finding",
    "Kind",
    "KvpatchWarning",
    "NotApplied",
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
    "require_applied",
]

__version__ = "0.1.0"

log = logging.getLogger(__name__)
_engine: Engine | None = None
_lock = threading.Lock()


def _build() -> Engine:
    from . import registry

    reg = registry.load()
    return Engine(reg.patches, broken=reg.broken)


def get_engine() -> Engine:
    """The process's engine (built on first use; not necessarily active)."""
    global _engine
    with _lock:
        if _engine is None:
            _engine = _build()
        return _engine


def activate() -> Engine | None:
    """Activate kvpatch in this process (idempotent). Never raises; returns ``None`` on failure."""
    try:
        engine = get_engine()
        if engine.config.enabled:
            engine.activate()
            if os.environ.get("KVPATCH_VENDORED"):  # opt-in: patch vendored copies (kvpatch.vendored)
                from . import vendored

                vendored.hook(engine)
        return engine
    except Exception as exc:  # kvpatch must never break the user's program
        message = f"kvpatch could not activate: {type(exc).__name__}: {exc}"
        log.warning("%s", message)
        warnings.warn(message, KvpatchWarning, stacklevel=2)
        return None


def deactivate() -> None:
    """Restore every patched original in this process."""
    if _engine is not None:
        _engine.deactivate()
    vendored = sys.modules.get(f"{__name__}.vendored")
    if vendored is not None:
        vendored.restore()


def records() -> list[PatchStatus]:
    """The status of every patch in this process, for servers that assert kvpatch is active."""
    engine = get_engine()
    return [engine.status[p.id] for p in engine.patches]


def __getattr__(name: str) -> object:
    # The start-up assertions load on first use (kvpatch.require_applied / kvpatch.NotApplied).
    if name in ("NotApplied", "require_applied"):
        from . import assertions

        return getattr(assertions, name)
    raise AttributeError(f"module 'kvpatch' has no attribute {name!r}")


activate()
