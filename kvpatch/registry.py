"""Discover the patch units.

The units live in the ``kvpatch.patches`` package, one folder per distribution whose release gates them
(``kvpatch.patches.mlx_lm``, ``kvpatch.patches.mlx_vlm``); the underscore modules beside those folders are
shared fix helpers, not units.

:func:`load` imports every unit (``status``, ``verify``, tests). Auto-activation, which runs inside the
user's ``import mlx_lm``, uses :func:`index` instead: the gate's facts of every unit come from the shipped
index ``kvpatch/data/units.json`` (written by ``python -m kvpatch.maint.units --write`` and checked against
the units by ``tests/engine/test_unit_index.py``), and the engine imports only the units whose gate says
apply or verify (:class:`Stub`). An index that does not list exactly the units on disk (a checkout where a
unit was added, renamed or removed) is not used: every unit is imported, as :func:`load` does.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import pkgutil
import sys
from collections.abc import Iterable, Iterator
from functools import cached_property, lru_cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .record import DISTRIBUTIONS, Patch

if TYPE_CHECKING:
    from packaging.specifiers import SpecifierSet

__all__ = ["Registry", "Stub", "index", "load"]

PACKAGE = "kvpatch.patches"
INDEX = "units.json"
#: The record fields the gate and the engine's ordering read, as the unit index stores them.
INDEXED = (
    "id",
    "distribution",
    "affected",
    "fixed_in",
    "fixed_commit",
    "introduced_commit",
    "checked_through",
    "order",
    "opt_in",
)


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
    folder = Path(__file__).resolve().parent / "patches"
    init = folder / "__init__.py"
    if not init.is_file():
        raise ModuleNotFoundError(f"kvpatch's patch units are missing (looked for {PACKAGE} and {folder})")
    spec = importlib.util.spec_from_file_location(PACKAGE, init, submodule_search_locations=[str(folder)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    spec.loader.exec_module(module)
    return module


def _unit(name: str) -> Patch:
    """Import the unit ``name`` (a full module name) and return its checked record."""
    module = importlib.import_module(name)
    patch = module.PATCH
    if not isinstance(patch, Patch):
        raise TypeError(f"{name}.PATCH is {type(patch).__name__}, not a Patch")
    if patch.reproduction is None:
        raise TypeError(f"{name}: patch {patch.id} has no reproduction")
    patch.module = name
    return patch


def _unit_names(package: ModuleType) -> list[str]:
    """The unit modules in ``package``'s distribution folders (underscore modules are not units), sorted."""
    return sorted(
        f"{PACKAGE}.{folder}.{info.name}"
        for folder in DISTRIBUTIONS.values()
        for info in pkgutil.iter_modules([str(Path(root) / folder) for root in package.__path__])
        if info.name[0] != "_"
    )


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
    for name in _unit_names(package):
        try:
            patch = _unit(name)
            if patch.id in seen:
                raise ValueError(f"patch id {patch.id!r} is used by {seen[patch.id]} too")
        except Exception as exc:
            broken[name] = f"{type(exc).__name__}: {exc}"
            continue
        seen[patch.id] = name
        patches.append(patch)
    return Registry(patches, broken)


class Stub:
    """A patch known from the unit index, its unit not imported yet.

    It carries the :data:`INDEXED` fields (and ``specifier``, ``range``, ``import_name``), which is all the gate
    and the engine's ordering read; nothing else (reading it does not import the unit). The engine swaps a stub
    for its record before it installs or verifies anything, and whenever every record is read
    (:meth:`kvpatch.engine.Engine.materialise`, through :meth:`resolve`).
    """

    id: str
    distribution: str
    affected: str
    fixed_in: str | None
    fixed_commit: str | None
    introduced_commit: str | None
    checked_through: str | None
    order: int
    opt_in: bool

    def __init__(self, module: str, fields: dict[str, Any]) -> None:
        self.module = module
        for name in INDEXED:
            setattr(self, name, fields[name])
        self._record: Patch | None = None

    @cached_property
    def specifier(self) -> SpecifierSet:
        from packaging.specifiers import SpecifierSet

        return SpecifierSet(self.affected)

    @property
    def range(self) -> SpecifierSet:
        """What the gate reads (:attr:`kvpatch.record.Patch.range`)."""
        return self.specifier

    @property
    def import_name(self) -> str:
        return DISTRIBUTIONS[self.distribution]

    def resolve(self) -> Patch:
        """The unit's record (imported on first use); raises what importing it raises."""
        if self._record is None:
            record = _unit(self.module)
            if record.id != self.id:
                raise ValueError(f"{self.module} defines {record.id!r}, the unit index says {self.id!r}")
            self._record = record
        return self._record

    def __repr__(self) -> str:
        return f"Stub({self.id!r}, {self.module})"


def entries(patches: Iterable[Patch]) -> dict[str, dict[str, Any]]:
    """The unit index of ``patches``: unit module name -> the :data:`INDEXED` fields (what ``units.json`` holds)."""
    return {p.module: {name: getattr(p, name) for name in INDEXED} for p in sorted(patches, key=lambda p: p.module)}


def index_path() -> Path:
    """Where the shipped unit index lives (``kvpatch/data/units.json``)."""
    return Path(__file__).parent / "data" / INDEX


def index() -> list[Stub] | None:
    """A :class:`Stub` per unit from the shipped index, or ``None`` when the index is missing, unreadable or
    does not list exactly the units on disk (then :func:`load` is the way). Never raises."""
    try:
        package = _patches_package()
        data = json.loads(index_path().read_text(encoding="utf-8"))
        units = data["units"]
        if sorted(units) != _unit_names(package):
            return None
        return [Stub(name, fields) for name, fields in units.items()]
    except Exception:
        return None
