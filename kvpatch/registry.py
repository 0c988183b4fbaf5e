"""The patch units (``kvpatch.patches.mlx_lm`` / ``mlx_vlm``; underscore modules are helpers): :func:`load` imports
them all; :func:`index` gives a :class:`Stub` per unit from ``units.json``, so that ``import mlx_lm`` imports only
the units whose gate may apply."""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from packaging.specifiers import SpecifierSet

from ._warn import failure
from .record import DISTRIBUTIONS, Patch

PACKAGE = "kvpatch.patches"
INDEX = Path(__file__).parent / "data" / "units.json"


class Registry(NamedTuple):
    patches: list[Patch]
    broken: dict[str, str]  # unit module -> why it could not be loaded


def _unit(name: str) -> Patch:
    patch = importlib.import_module(name).PATCH
    if not isinstance(patch, Patch) or patch.reproduction is None:
        raise TypeError(f"{name}.PATCH is not a Patch with a reproduction")
    patch.module = name
    return patch


def _unit_names() -> list[str]:
    return sorted(
        f"{PACKAGE}.{folder}.{info.name}"
        for folder in DISTRIBUTIONS.values()
        for info in pkgutil.iter_modules([str(Path(__file__).parent / "patches" / folder)])
        if info.name[0] != "_"
    )


@lru_cache(maxsize=1)
def load() -> Registry:
    """Import every patch unit; a unit that fails to import is recorded, never raised."""
    patches: dict[str, Patch] = {}
    broken: dict[str, str] = {}
    for name in _unit_names():
        try:
            patch = _unit(name)
            if patch.id in patches:
                raise ValueError(f"patch id {patch.id!r} is used by {patches[patch.id].module} too")
            patches[patch.id] = patch
        except Exception as exc:
            broken[name] = failure(exc)
    return Registry(list(patches.values()), broken)


@dataclass(eq=False)
class Stub:
    """A patch known from the unit index, its unit not imported: the fields the gate and the engine's ordering
    read. The engine swaps it for its record (:meth:`resolve`) before using anything else."""

    module: str
    id: str
    distribution: str
    affected: str
    fixed_in: str | None
    fixed_commit: str | None
    introduced_commit: str | None
    checked_through: str | None
    order: int
    opt_in: bool

    def __post_init__(self) -> None:
        self.range = SpecifierSet(self.affected)

    @property
    def import_name(self) -> str:
        return DISTRIBUTIONS[self.distribution]

    def resolve(self) -> Patch:
        record = _unit(self.module)
        if record.id != self.id:
            raise ValueError(f"{self.module} defines {record.id!r}, the unit index says {self.id!r}")
        return record


class Unloadable(NamedTuple):
    """Why a unit could not be imported; ``gone``: its file is gone (kvpatch was uninstalled or replaced since)."""

    error: str
    gone: bool


def resolve(stubs: Iterable[Stub]) -> dict[str, Patch | Unloadable]:
    """Each stub's record, its unit imported (a unit's code runs), or why it could not be."""
    results: dict[str, Patch | Unloadable] = {}
    for stub in stubs:
        try:
            results[stub.id] = stub.resolve()
        except Exception as exc:
            missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
            gone = bool(missing) and f"{stub.module}.".startswith(f"{missing}.")
            results[stub.id] = Unloadable(failure(exc), gone)
    return results


def index() -> list[Stub] | None:
    """A :class:`Stub` per unit; ``None`` (never raises) where the index is unusable or not exactly the units."""
    try:
        units = json.loads(INDEX.read_text(encoding="utf-8"))["units"]
        return [Stub(name, **units[name]) for name in units] if sorted(units) == _unit_names() else None
    except Exception:
        return None


def module_for(patch_id: str, distribution: str) -> str:
    """The unit module a patch's record must live in (CONTRIBUTING.md, "Layout"): the folder of the distribution
    whose release gates it, and the id with ``-`` as ``_``, less the ``lm``/``vlm`` prefix or suffix that the
    folder already says (``offset-detach-vlm`` -> ``kvpatch.patches.mlx_vlm.offset_detach``)."""
    short = distribution.removeprefix("mlx-")
    name = patch_id.removeprefix(f"{short}-").removesuffix(f"-{short}")
    return f"{PACKAGE}.{DISTRIBUTIONS[distribution]}.{name.replace('-', '_')}"
