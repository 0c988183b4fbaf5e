"""kvpatch's start-up bootstrap, run from ``kvpatch.pth`` in every Python process of the environment.

It must cost nothing measurable: it imports only ``os`` and ``sys`` (both already loaded at start-up)
and puts one tiny finder at the front of ``sys.meta_path``. The finder never finds anything; the
first time something imports ``mlx_lm`` or ``mlx_vlm`` it removes itself and imports kvpatch, which
registers the real post-import hooks before the upstream package executes.

PYTEST_DONT_REWRITE
"""

import os
import sys

_WATCHED = frozenset(("mlx_lm", "mlx_vlm"))


class KvpatchBootstrapFinder:
    """Activates kvpatch when mlx-lm or mlx-vlm is first imported; finds nothing itself."""

    _busy = False

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in _WATCHED or cls._busy:
            return None
        cls._busy = True
        try:
            try:
                sys.meta_path.remove(cls)
            except ValueError:
                pass
            import kvpatch  # noqa: F401  (importing activates; it never raises)
        except Exception as exc:  # kvpatch must never break the user's import
            try:
                import warnings

                warnings.warn(f"kvpatch bootstrap failed: {type(exc).__name__}: {exc}", stacklevel=2)
            except Exception:
                pass
        finally:
            cls._busy = False
        # We are inside the import system's loop over sys.meta_path for this very package, and
        # kvpatch has just put wrapt's post-import finder at the front of it, where that loop will
        # not look again: ask the finders now in place, so the package's own hook fires too.
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if find is None or finder is cls:
                continue
            spec = find(name, path, target)
            if spec is not None:
                return spec
        return None

    @classmethod
    def invalidate_caches(cls):
        return None


def install():
    if os.environ.get("KVPATCH", "").strip().lower() in ("off", "0", "false", "no", "disable", "disabled"):
        return
    if "kvpatch" in sys.modules or KvpatchBootstrapFinder in sys.meta_path:
        return
    if _WATCHED.intersection(sys.modules):  # pragma: no cover - upstream already imported this early
        try:
            import kvpatch  # noqa: F401
        except Exception:
            pass
        return
    sys.meta_path.insert(0, KvpatchBootstrapFinder)


install()
