"""kvpatch's import machinery, loaded by ``_kvpatch_boot`` on the first ``mlx_lm`` / ``mlx_vlm`` import: activation
on first use and post-import hooks that cannot deadlock (docs/activation.md). It imports nothing not loaded already.
``find_spec`` runs under the global import lock: it never imports or waits, and asks the other finders with the
``path`` the import system computed (``importlib.util.find_spec`` would import the parent package, which a thread
waiting for that lock may be executing: wrapt's finder hangs so, and is skipped; its hooks fire through its
``notify_module_loaded``). Activation and hooks run after the module's code, outside every lock of ours."""

import _thread
import os
import sys

_WATCHED = ("mlx_lm", "mlx_vlm")
_also: set = set()  # modules a hook was registered for (beyond _WATCHED: a server's vendored copy of upstream code)

_lock = _thread.allocate_lock()  # guards the tables below; never held while importing or calling out
_hooks: dict = {}  # module name -> callables waiting for it
_running: dict = {}  # module name -> how many of our loaders are executing it now
_tls = _thread._local()
_warned: set = set()
_activated = False
# Set by _kvpatch_boot before any use: its finder, its ``first`` (keeps that finder first on sys.meta_path: wrapt
# puts its own at the front when first used), the trusted start-up path, its directory, its is_off.
_finder = _first = _startup_path = _site_dir = _is_off = None


def _after_fork():
    """In a child of os.fork: a lock another thread of the parent held would be held forever."""
    global _lock
    _lock = _thread.allocate_lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def register_post_import_hook(hook, name):
    """Call ``hook(module)`` once module ``name`` is imported (now, if it is already), in the importing thread,
    after the module's code, no lock held: wrapt's ``register_post_import_hook`` without its finder."""
    _first()
    with _lock:
        _also.add(name)
        module = sys.modules.get(name)
        if module is None or _running.get(name):
            _hooks.setdefault(name, []).append(hook)
            return
    _call(hook, module)


def _notify(module):
    with _lock:
        waiting = _hooks.pop(module.__name__, ())
    for hook in waiting:
        _call(hook, module)
    wrapt_importer = sys.modules.get("wrapt.importer")
    if wrapt_importer is not None:
        _call(wrapt_importer.notify_module_loaded, module, "a wrapt ")


def _call(hook, module, whose=""):
    try:
        hook(module)
    except Exception as exc:
        _warn(f"{whose}post-import hook for {module.__name__} failed: {type(exc).__name__}: {exc}")


def find_spec(name, path=None, target=None):
    top, dot, _ = name.partition(".")
    if top in _WATCHED or name in _also:  # the others' spec, its loader wrapped
        for finder in _others():
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if hasattr(spec.loader, "exec_module") and not isinstance(spec.loader, _Loader):
                    spec.loader = _Loader(spec.loader, top in _WATCHED and not dot)
                return spec
        return None
    if not dot and getattr(_tls, "activating", False) and name not in sys.modules:
        return _own_spec(name, target)
    return None


def _others():
    """The other finders, without wrapt's (its hooks fire through notify_module_loaded; its lookup imports)."""
    for finder in sys.meta_path:
        kind = type(finder)
        wrapt = kind.__name__ == "ImportHookFinder" and kind.__module__ == "wrapt.importer"
        if finder is not _finder and not wrapt and hasattr(finder, "find_spec"):
            yield finder


def _own_spec(name, target):
    """A top-level module for kvpatch's activation, outside the working and script directories."""
    path_finder = sys.modules["_frozen_importlib_external"].PathFinder
    untrusted = {"", os.curdir}
    try:
        untrusted.add(os.getcwd())
    except OSError:
        pass
    argv0 = (getattr(sys, "argv", None) or [""])[0]
    if argv0 and argv0 not in ("-c", "-m"):
        untrusted.add(os.path.dirname(os.path.abspath(argv0)))
    trusted = [_site_dir]
    for entry in sys.path:
        if isinstance(entry, str) and entry not in trusted:
            if entry in _startup_path or (entry not in untrusted and os.path.abspath(entry) not in untrusted):
                trusted.append(entry)
    for finder in _others():
        spec = finder.find_spec(name, trusted if finder is path_finder else None, target)
        if spec is not None:
            return spec
    message = f"No module named {name!r}"
    if path_finder.find_spec(name, None, target) is not None:
        message += " outside the working or script directory (kvpatch does not import from there)"
    raise ModuleNotFoundError(message, name=name)


class _Loader:
    """Wraps an upstream module's loader: activation and hooks after the module's code ran."""

    def __init__(self, loader, top):
        self._kvpatch_loader = loader
        self._kvpatch_top = top

    def __getattr__(self, attr):  # create_module, get_code, get_source, ...
        if attr.startswith("_kvpatch_"):
            raise AttributeError(attr)
        return getattr(self._kvpatch_loader, attr)

    def exec_module(self, module):
        loader = self._kvpatch_loader
        # The module keeps its own loader, as if we had never been there.
        if getattr(module, "__loader__", None) is self:
            try:
                module.__loader__ = loader
            except AttributeError:
                pass
        if getattr(getattr(module, "__spec__", None), "loader", None) is self:
            module.__spec__.loader = loader
        name = module.__name__
        with _lock:
            _running[name] = _running.get(name, 0) + 1
        try:
            loader.exec_module(module)
        finally:
            with _lock:
                _running[name] -= 1
        if self._kvpatch_top:
            _activate()
        _notify(module)


def _activate():
    """Import (and so activate) kvpatch from its own site directory. Idempotent, never raises."""
    global _activated
    if _activated or getattr(_tls, "activating", False):
        return
    if not _is_off():
        _tls.activating = True
        try:
            import kvpatch  # noqa: F401  (importing activates)
        except Exception as exc:
            _warn(f"kvpatch could not activate: {type(exc).__name__}: {exc}")
        finally:
            _tls.activating = False
        _first()
    _activated = True


def _warn(message):
    """Through ``kvpatch._warn`` when loaded; else (no warning category to filter) on stderr, once."""
    try:
        one_path = sys.modules.get("kvpatch._warn")
        if one_path is not None:
            one_path.emit(message)
        elif message not in _warned:
            _warned.add(message)
            sys.stderr.write(f"kvpatch: warning: {message[:500]}\n")
    except Exception:
        pass
