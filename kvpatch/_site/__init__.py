"""The start-up bootstrap, reachable from inside kvpatch: the wheel installs these files at the top of site-packages,
a source tree has them here; a process that did not start through them (``python -S``, ``KVPATCH=off`` at start-up,
a ``--target`` install) loads them from either place."""

from __future__ import annotations

import contextlib
import os
import sys
from types import ModuleType


class BrokenInstall(ImportError):
    """A file of kvpatch's own install is missing or cannot be loaded: only reinstalling mends it."""


def hooks() -> ModuleType | None:
    """The process's post-import hook registry (``_kvpatch_hooks``); ``None`` if it cannot load."""
    try:
        return boot().hooks()
    except Exception:
        return None


def boot() -> ModuleType:
    """The bootstrap module (``_kvpatch_boot``), loaded for a process that did not start through it
    (:class:`BrokenInstall` when the install lacks it)."""
    module = sys.modules.get("_kvpatch_boot")
    if module is not None:
        return module
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for folder in (os.path.dirname(os.path.dirname(here)), here):  # the installed top-level copy first: one registry
        path = os.path.join(folder, "_kvpatch_boot.py")
        spec = importlib.util.spec_from_file_location("_kvpatch_boot", path)
        if spec is not None and spec.loader is not None and os.path.isfile(path):
            module = importlib.util.module_from_spec(spec)
            with contextlib.suppress(Exception):
                spec.loader.exec_module(module)
                return sys.modules.setdefault("_kvpatch_boot", module)  # a thread that lost the race uses the winner's
    raise BrokenInstall("kvpatch's bootstrap (_kvpatch_boot.py) cannot be loaded: reinstall kvpatch")
