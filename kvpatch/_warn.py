"""The one path every kvpatch warning takes: once per key, never raised into the host.

* Through ``warnings`` (category :class:`KvpatchWarning`), pointing at the first frame outside kvpatch,
  the import machinery, wrapt and the bootstrap: the user's ``import`` line, not kvpatch's own files.
* Under ``-W error`` (or pytest's ``filterwarnings = error``) ``warnings.warn`` raises; the host must not
  see that, so the message goes to standard error instead, once.
* Logged at INFO on the ``kvpatch`` logger, which has a ``NullHandler``: nothing is printed by logging's
  last-resort handler, and whoever configures logging for ``kvpatch`` gets every message.
* Long messages (a 100 KB environment value) are cut.
* The bootstrap's import machinery (``_kvpatch_hooks``, which cannot import kvpatch) warns through here
  whenever this module is loaded.

Imports nothing beyond the standard library, and never changes warning filters.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings

__all__ = ["KvpatchWarning", "emit", "shorten"]

log = logging.getLogger("kvpatch")
if not any(isinstance(h, logging.NullHandler) for h in log.handlers):
    log.addHandler(logging.NullHandler())

_MAX = 600
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_emitted: set[str] = set()
_emitted_lock = threading.Lock()


class KvpatchWarning(UserWarning):
    """Something about kvpatch's patches needs attention (only ever warned, never raised)."""


def shorten(text: str, limit: int = _MAX) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters]"


def _internal(filename: str) -> bool:
    return (
        filename.startswith(_PACKAGE_DIR)
        or filename.startswith("<frozen importlib")
        or "importlib" in filename
        or os.path.basename(filename) in ("_kvpatch_boot.py", "_kvpatch_hooks.py")
        or f"{os.sep}wrapt{os.sep}" in filename
    )


def _stacklevel() -> int:
    """The ``stacklevel`` (relative to :func:`emit`'s ``warnings.warn`` call) of the first outside frame."""
    frame = sys._getframe(1)  # emit
    level = 1
    while frame is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level if frame is not None else 1


def emit(message: str, *, key: str | None = None) -> bool:
    """Warn once per ``key`` (default: the message). Never raises. True if it was emitted now."""
    try:
        message = shorten(message)
        key = key or message
        with _emitted_lock:
            if key in _emitted:
                return False
            _emitted.add(key)
        log.info("%s", message)
        try:
            warnings.warn(message, KvpatchWarning, stacklevel=_stacklevel())
        except Exception:  # -W error made it an exception: say it on stderr instead, never raise
            try:
                sys.stderr.write(f"kvpatch: {message}\n")
            except Exception:
                pass
        return True
    except Exception:  # pragma: no cover - nothing in here may reach the host
        return False
