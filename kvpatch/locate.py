"""Find a module's file without importing it (or any package above it), and stamp a file.

Verdict keys, the settled-status key and the vendored-copy scan stat or read upstream's files before (or
without) importing them. An imported module answers with its ``__file__``; otherwise the top-level name goes
through :func:`importlib.util.find_spec` (it consults ``sys.meta_path``, so editable installs served by a finder
are found, and imports nothing for a top-level name) and the submodule is looked for in the package's directories.
"""

from __future__ import annotations

import importlib.util
import os
import sys

__all__ = ["module_file", "stamp"]


def module_file(name: str) -> str | None:
    """The file of module ``name`` (``None``: not found). Never imports, never raises."""
    try:
        module = sys.modules.get(name)
        found = getattr(module, "__file__", None) if module is not None else None
        if found:
            return str(found)
        top, _, rest = name.partition(".")
        package = sys.modules.get(top)
        origin = getattr(package, "__file__", None) if package is not None else None
        if origin:  # an imported package: its directory
            if not rest:
                return str(origin)
            locations = list(getattr(package, "__path__", None) or [os.path.dirname(origin)])
        else:
            spec = importlib.util.find_spec(top)
            if spec is None:
                return None
            if not rest:
                return str(spec.origin) if spec.origin else None
            locations = list(spec.submodule_search_locations or ())
        for base in locations:
            stem = os.path.join(base, *rest.split("."))
            for candidate in (stem + ".py", os.path.join(stem, "__init__.py")):
                if os.path.isfile(candidate):
                    return candidate
        return None
    except Exception:  # ImportError, ValueError, a broken finder: not found
        return None


def stamp(path: str | None) -> tuple[int, int] | None:
    """(size, mtime_ns) of the file at ``path`` (``None``: no path, or it cannot be stat'ed)."""
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns) if st else None
