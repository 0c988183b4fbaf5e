"""Discover the patch units: :func:`load` imports every one (``status``, ``verify``, tests); :func:`index` gives a
:class:`Stub` per unit from the shipped ``kvpatch/data/units.json``, so that activation inside the user's
``import mlx_lm`` imports only the units whose gate may apply. An index that does not list exactly the units on
disk is not used. Units live in one folder per distribution whose release gates them
(``kvpatch.patches.mlx_lm``, ``kvpatch.patches.mlx_vlm``); underscore modules beside them are shared helpers.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import pkgutil
from collections.abc import Iterable
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
#: The record fields the gate and the engine's ordering read: what the unit index stores.
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

    def get(self, patch_id: str) -> Patch:
        try:
            return self.by_id[patch_id]
        except KeyError:
            raise KeyError(f"no patch {patch_id!r}; known: {', '.join(sorted(self.by_id))}") from None


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
        package = importlib.import_module(PACKAGE)
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
    """A patch known from the unit index, its unit not imported: the :data:`INDEXED` fields and what the gate
    derives from them. The engine swaps it for its record (:meth:`resolve`) before using anything else."""

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
    def range(self) -> SpecifierSet:
        """What the gate reads (:attr:`kvpatch.record.Patch.range`)."""
        from packaging.specifiers import SpecifierSet

        return SpecifierSet(self.affected)

    @property
    def import_name(self) -> str:
        return DISTRIBUTIONS[self.distribution]

    def resolve(self) -> Patch:
        """The unit's record (imported on first use)."""
        if self._record is None:
            record = _unit(self.module)
            if record.id != self.id:
                raise ValueError(f"{self.module} defines {record.id!r}, the unit index says {self.id!r}")
            self._record = record
        return self._record

    def __repr__(self) -> str:
        return f"Stub({self.id!r}, {self.module})"


def entries(patches: Iterable[Patch]) -> dict[str, dict[str, Any]]:
    """What ``units.json`` holds for ``patches``: unit module name -> the :data:`INDEXED` fields."""
    return {p.module: {name: getattr(p, name) for name in INDEXED} for p in sorted(patches, key=lambda p: p.module)}


def index_path() -> Path:
    return Path(__file__).parent / "data" / INDEX


def index() -> list[Stub] | None:
    """A :class:`Stub` per unit, or ``None`` when the index is missing, unreadable or does not list exactly the
    units on disk (then :func:`load` is the way). Never raises."""
    try:
        package = importlib.import_module(PACKAGE)
        data = json.loads(index_path().read_text(encoding="utf-8"))
        units = data["units"]
        if sorted(units) != _unit_names(package):
            return None
        return [Stub(name, fields) for name, fields in units.items()]
    except Exception:
        return None
