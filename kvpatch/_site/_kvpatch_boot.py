"""kvpatch's start-up hook, run in every process of the environment (kvpatch.pth; kvpatch.start from 3.15).

Kept tiny on purpose: this file is compiled at every start where no bytecode is cached. The rest of
the machinery is in _kvpatch_hooks.py, loaded beside it the first time mlx_lm or mlx_vlm is imported.
PYTEST_DONT_REWRITE
"""

import os
import sys

_OFF = ("off", "0", "false", "no", "disable", "disabled")
_TRIGGERS = ("mlx_lm", "mlx_vlm")
_impl = None
_startup_path = ()


class KvpatchBootstrapFinder:
    """First on sys.meta_path; ignores every import until mlx_lm or mlx_vlm is imported."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if _impl is None:
            if not name.startswith(_TRIGGERS) or hooks() is None:
                return None
        return _impl.find_spec(name, path, target)


def hooks():
    """The import machinery module (_kvpatch_hooks), loaded from this file's directory on first use."""
    global _impl
    if _impl is None:
        module = sys.modules.get("_kvpatch_hooks")
        if module is None:
            # No import statement: this can run inside the import system's lock (in find_spec),
            # where importing anything not loaded yet could wait on another thread's import.
            ext, boot = sys.modules["_frozen_importlib_external"], sys.modules["_frozen_importlib"]
            here = os.path.join(os.path.dirname(__file__), "_kvpatch_hooks.py")
            try:
                spec = ext.spec_from_file_location("_kvpatch_hooks", here)
                module = boot.module_from_spec(spec)
                sys.modules["_kvpatch_hooks"] = module
                spec.loader.exec_module(module)
            except Exception as exc:  # a broken install must never break the user's imports
                sys.modules.pop("_kvpatch_hooks", None)
                KvpatchBootstrapFinder.find_spec = staticmethod(lambda name, path=None, target=None: None)
                sys.stderr.write(f"kvpatch: bootstrap disabled ({type(exc).__name__}: {exc})\n")
                return None
        module._setup(KvpatchBootstrapFinder, _startup_path, __file__)
        _impl = module
    return _impl


def install(force=False):
    """Put the finder first on sys.meta_path (idempotent); nothing with KVPATCH=off unless forced."""
    global _startup_path
    if not force and os.environ.get("KVPATCH", "").strip().lower() in _OFF:
        return
    if not _startup_path:
        _startup_path = tuple(sys.path)  # before the interpreter adds the script's or working directory
    if KvpatchBootstrapFinder not in sys.meta_path:
        sys.meta_path.insert(0, KvpatchBootstrapFinder)
