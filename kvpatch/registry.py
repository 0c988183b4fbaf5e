"""Discover the patch units.

In an installed kvpatch the units live in the ``kvpatch.patches`` package (the wheel maps the
repository's top-level ``patches/`` folder there). In a source checkout or an editable install the
same folder is found beside the ``kvpatch`` package and loaded under the same name.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from .record import Patch

__all__ = ["Registry", "load"]

PACKAGE = "kvpatch.patches"


class Registry:
    def __init__(self, patches: list[Patch], broken: dict[str, str]) -> None:
        self.patches = patches
        self.broken = broken
        self.by_id = {p.id: p for p in patches}

    def __iter__(self) -> Iterator[Patch]:
        return iter(self.patches)

    def __len__(self) -> int:
        return len(self.patches)

    def get(self, patch_id: str) -> Patch:
        try:
            return self.by_id[patch_id]
        except KeyError:
            raise KeyError(f"no patch {patch_id!r}; known: {', '.join(sorted(self.by_id))}") from None


def _patches_package() -> ModuleType:
    try:
        return importlib.import_module(PACKAGE)
    except ModuleNotFoundError as exc:
        if exc.name != PACKAGE:
            raise
    folder = Path(__file__).resolve().parent.parent / "patches"
    init = folder / "__init__.py"
    if not init.is_file():
        raise ModuleNotFoundError(f"kvpatch's patch units are missing (looked for {PACKAGE} and {folder})")
    spec = importlib.util.spec_from_file_location(PACKAGE, init, submodule_search_locations=[str(folder)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=1)
def load() -> Registry:
    """Import every patch unit; a unit that fails to import is recorded, never raised."""
    patches: list[Patch] = []
    broken: dict[str, str] = {}
    try:
        package = _patches_package()
    except Exception as exc:
        return Registry([], {PACKAGE: f"{type(exc).__name__}: {exc}"})
    seen: dict[str, str] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        name = f"{PACKAGE}.{info.name}"
        try:
            module = importlib.import_module(name)
            patch = module.PATCH
            if not isinstance(patch, Patch):
                raise TypeError(f"{name}.PATCH is {type(patch).__name__}, not a Patch")
            if patch.reproduction is None:
                raise TypeError(f"{name}: patch {patch.id} has no reproduction")
            if patch.id in seen:
                raise ValueError(f"patch id {patch.id!r} is used by {seen[patch.id]} too")
        except Exception as exc:
            broken[name] = f"{type(exc).__name__}: {exc}"
            continue
        patch.module = name
        seen[patch.id] = name
        patches.append(patch)
    return Registry(patches, broken)
