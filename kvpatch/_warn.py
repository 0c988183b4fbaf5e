"""The one path every kvpatch warning takes: once per key, as :class:`KvpatchWarning` at the user's ``import``
line; under ``-W error`` on standard error instead, never raised. Each is also logged at INFO on the ``kvpatch``
logger, whose ``NullHandler`` keeps logging's last resort quiet. Warning filters are never changed.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings

log = logging.getLogger("kvpatch")
if not any(isinstance(h, logging.NullHandler) for h in log.handlers):
    log.addHandler(logging.NullHandler())

_MAX = 600
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_emitted: set[str] = set()
_emitted_lock = threading.Lock()


def _after_fork() -> None:
    """In a child of ``os.fork``: a lock another thread of the parent held would be held forever."""
    global _emitted_lock
    _emitted_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


class KvpatchWarning(UserWarning):
    """Something about kvpatch's patches needs attention (only ever warned, never raised)."""


def failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def quoted(path: object) -> str:
    """``path`` for a message: quoted, a line break or control character in it escaped (never a forged line)."""
    return repr(str(path))


def _stacklevel() -> int:
    """The ``stacklevel`` (relative to :func:`emit`'s ``warnings.warn`` call) of the first outside frame."""
    frame = sys._getframe(1)  # emit
    level = 1
    while frame is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE_DIR)
        or "importlib" in frame.f_code.co_filename
        or os.path.basename(frame.f_code.co_filename) in ("_kvpatch_boot.py", "_kvpatch_hooks.py")
        or f"{os.sep}wrapt{os.sep}" in frame.f_code.co_filename
    ):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level if frame is not None else 1


def emit(message: str, *, key: str | None = None) -> None:
    """Warn once per ``key`` (default: the message). Never raises."""
    try:
        if len(message) > _MAX:
            message = f"{message[:_MAX]}... [{len(message) - _MAX} more characters]"
        with _emitted_lock:
            if (key or message) in _emitted:
                return
            _emitted.add(key or message)
        log.info("%s", message)
        try:
            warnings.warn(message, KvpatchWarning, stacklevel=_stacklevel())
        except Exception:  # -W error made it an exception: say it on stderr instead, never raise
            sys.stderr.write(f"kvpatch: {message}\n")
    except Exception:  # nothing in here may reach the host (a failing stderr included)
        pass
