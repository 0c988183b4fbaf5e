"""The start-up bootstrap, and access to its import machinery from inside kvpatch.

The wheel installs ``kvpatch.pth``, ``kvpatch.start``, ``_kvpatch_boot.py`` and ``_kvpatch_hooks.py`` at the top
of site-packages (where ``site`` runs them), beside this package; a source tree on ``PYTHONPATH`` has them here.
This package finds them in either place for processes that did not start through them (``python -S``,
``KVPATCH=off`` at start-up, a ``--target`` install).
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
    boot = sys.modules.get("_kvpatch_boot")
    if boot is None:
        boot = _load_boot()
        if boot is None:
            return None
    try:
        return boot.hooks()
    except Exception:
        return None


def boot() -> ModuleType:
    """The bootstrap module (``_kvpatch_boot``): the one kvpatch.pth / kvpatch.start run, loaded here for a
    process that did not start through them. Its ``is_off`` is the one reading of ``KVPATCH=off``
    (:mod:`kvpatch.config` uses it). Raises ImportError when the install lacks it."""
    module = sys.modules.get("_kvpatch_boot") or _load_boot()
    if module is None:
        raise ImportError("kvpatch's bootstrap (_kvpatch_boot.py) cannot be loaded: reinstall kvpatch")
    return module


def _load_boot() -> ModuleType | None:
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    site_dir = os.path.dirname(os.path.dirname(here))
    for folder in (site_dir, here):  # the installed top-level copy first, so there is one registry
        path = os.path.join(folder, "_kvpatch_boot.py")
        if not os.path.isfile(path):
            continue
        spec = importlib.util.spec_from_file_location("_kvpatch_boot", path)
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        module = sys.modules.setdefault("_kvpatch_boot", module)
        if getattr(module, "hooks", None) is None:
            try:
                spec.loader.exec_module(module)
            except Exception:
                sys.modules.pop("_kvpatch_boot", None)
                continue
        return module
    return None
