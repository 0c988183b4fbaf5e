"""Find a module's file without importing it (or any package above it): a top-level name not imported goes through
:func:`importlib.util.find_spec`, which consults ``sys.meta_path`` (editable installs' finders) and imports nothing."""

from __future__ import annotations

import importlib.util
import os
import sys


def module_file(name: str) -> str | None:
    """The file of module ``name`` (``None``: not found). Never imports, never raises."""
    try:
        if found := getattr(sys.modules.get(name), "__file__", None):
            return str(found)
        top, _, rest = name.partition(".")
        package = sys.modules.get(top)
        origin = getattr(package, "__file__", None)
        if origin:  # an imported package (``name`` is below it): its directories
            locations = list(getattr(package, "__path__", None) or [os.path.dirname(origin)])
        else:
            spec = importlib.util.find_spec(top)
            if spec is None or not rest:
                return spec.origin if spec else None
            locations = list(spec.submodule_search_locations or ())
        stems = [os.path.join(base, *rest.split(".")) for base in locations]
        return next((c for s in stems for c in (s + ".py", os.path.join(s, "__init__.py")) if os.path.isfile(c)), None)
    except Exception:  # ImportError, ValueError, a broken finder: not found
        return None


def stamp(path: str | None) -> tuple[int, int] | None:
    """(size, mtime_ns) of the file at ``path`` (``None``: no path, or it cannot be stat'ed)."""
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns) if st else None
