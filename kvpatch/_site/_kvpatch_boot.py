"""kvpatch's bootstrap finder (PYTEST_DONT_REWRITE). Up to Python 3.14 kvpatch.pth's stand-in finder loads this file
on the first mlx_* import and hands over (``from_shim``); from 3.15 (PEP 829) site runs ``install`` (kvpatch.start)
at every start: keep this file small. The machinery is _kvpatch_hooks.py beside it."""

import os
import sys

_impl = None
_HERE = os.path.dirname(os.path.abspath(__file__))
OFF_VALUES = ("off", "0", "false", "no", "disable", "disabled")
_startup_path = None  # the start-up sys.path entries that stay trusted (None: not recorded yet)


def is_off(environ=None):
    """Whether KVPATCH (in ``environ``, default os.environ) turns kvpatch off: the one reading of it."""
    return (os.environ if environ is None else environ).get("KVPATCH", "").strip().lower() in OFF_VALUES


class KvpatchBootstrapFinder:
    """First on sys.meta_path; ignores every import until mlx_lm or mlx_vlm is imported."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if _impl is None and (not name.startswith(("mlx_lm", "mlx_vlm")) or hooks() is None):
            return None
        return _impl.find_spec(name, path, target)


def hooks():
    """The import machinery module (_kvpatch_hooks), loaded from this file's directory on first use."""
    global _impl
    if _impl is None:
        module = sys.modules.get("_kvpatch_hooks")
        if module is None:
            # No import statement: under the import lock (find_spec) it could wait on another thread.
            here = os.path.join(_HERE, "_kvpatch_hooks.py")
            try:
                spec = sys.modules["_frozen_importlib_external"].spec_from_file_location("_kvpatch_hooks", here)
                module = sys.modules["_frozen_importlib"].module_from_spec(spec)
                sys.modules["_kvpatch_hooks"] = module
                spec.loader.exec_module(module)
            except Exception as exc:  # a broken install never breaks the user's imports
                sys.modules.pop("_kvpatch_hooks", None)
                KvpatchBootstrapFinder.find_spec = staticmethod(lambda name, path=None, target=None: None)
                sys.stderr.write(f"kvpatch: bootstrap disabled ({type(exc).__name__}: {exc})\n")
                return None
        module._finder, module._first, module._site_dir, module._is_off = KvpatchBootstrapFinder, first, _HERE, is_off
        module._startup_path = tuple(sys.path) if _startup_path is None else _startup_path
        _impl = module
    return _impl


def install():
    """Put the finder first on sys.meta_path (idempotent); nothing with KVPATCH=off."""
    global _startup_path
    if is_off():
        return
    if _startup_path is None:
        _startup_path = tuple(sys.path)  # before the interpreter adds the script's or working directory
    first()


def first(on=True):
    """One bootstrap finder first on sys.meta_path (``on`` False: none), kvpatch.pth's stand-ins gone, in one slice
    assignment: a thread iterating sys.meta_path meanwhile never skips a finder."""
    meta_path = sys.meta_path
    rest = [f for f in meta_path if getattr(f, "__name__", "") != "KvpatchBootstrapFinder"]
    if not on:
        meta_path[:] = rest
    elif len(rest) + 1 != len(meta_path) or meta_path[0] is not KvpatchBootstrapFinder:
        meta_path[:] = [KvpatchBootstrapFinder, *rest]


def from_shim(name, path=None, target=None):
    """Take over from kvpatch.pth's stand-ins (none with KVPATCH=off); ``name`` "": at start-up with KVPATCH set."""
    global _startup_path
    if not name:
        return install()
    if is_off():
        return first(False)
    if _startup_path is None:  # the entries a user named (PYTHONPATH): trusted even as the working directory
        named = "" if sys.flags.ignore_environment else os.environ.get("PYTHONPATH", "")
        _startup_path = tuple(os.path.abspath(e) for e in named.split(os.pathsep) if e)
    first()
    return KvpatchBootstrapFinder.find_spec(name, path, target)
