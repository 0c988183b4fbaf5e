"""The start-up bootstrap, reachable from inside kvpatch.

The wheel installs ``kvpatch.pth``, ``kvpatch.start``, ``_kvpatch_boot.py`` and ``_kvpatch_hooks.py`` at the top
of site-packages (where ``site`` runs them), beside this package; a source tree on ``PYTHONPATH`` has them here.
A process that did not start through them (``python -S``, ``KVPATCH=off`` at start-up, a ``--target`` install)
loads them from either place.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

__all__ = ["boot", "hooks"]


def hooks() -> ModuleType | None:
    """The process's post-import hook registry (module ``_kvpatch_hooks``); ``None`` if it cannot load.

    ``hooks().register_post_import_hook(hook, name)`` has the contract of wrapt's function of the same
    name, without wrapt's finder (see ``_kvpatch_hooks``).
    """
    try:
        return boot().hooks()
    except Exception:
        return None


def boot() -> ModuleType:
    """The bootstrap module (``_kvpatch_boot``), loaded for a process that did not start through it. Its ``is_off``
    is the one reading of ``KVPATCH=off``. Raises ImportError when the install lacks it."""
    module = sys.modules.get("_kvpatch_boot")
    if module is not None:
        return module
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for folder in (os.path.dirname(os.path.dirname(here)), here):  # the installed top-level copy first: one registry
        path = os.path.join(folder, "_kvpatch_boot.py")
        spec = importlib.util.spec_from_file_location("_kvpatch_boot", path) if os.path.isfile(path) else None
        if spec is None or spec.loader is None:
            continue
        module = sys.modules.setdefault("_kvpatch_boot", importlib.util.module_from_spec(spec))
        if getattr(module, "hooks", None) is None:
            try:
                spec.loader.exec_module(module)
            except Exception:
                sys.modules.pop("_kvpatch_boot", None)
                continue
        return module
    raise ImportError("kvpatch's bootstrap (_kvpatch_boot.py) cannot be loaded: reinstall kvpatch")
