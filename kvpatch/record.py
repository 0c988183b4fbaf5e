"""Patch records: plain data, one *builder* per target (original, or ``None``, in, the replacement out: no wrapper
layer) and one *reproduction* returning a :class:`Finding`. Nothing here imports mlx, mlx-lm or mlx-vlm."""

from __future__ import annotations

import datetime as _dt
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ._warn import failure

#: The upstream distributions kvpatch patches, and their import names.
DISTRIBUTIONS: dict[str, str] = {"mlx-lm": "mlx_lm", "mlx-vlm": "mlx_vlm"}


class RecordError(ValueError):
    """A patch record is malformed."""


class Kind(enum.Enum):
    REPLACE = "replace"  # the attribute exists; the builder gets it and returns its replacement
    ADD = "add"  # the attribute is missing upstream; the builder returns the new attribute


@dataclass(frozen=True)
class Target:
    """One attribute that a patch changes: ``module`` plus a dotted ``qualname`` inside it."""

    module: str
    qualname: str
    kind: Kind = Kind.REPLACE
    optional: bool = False  # may be absent within the affected range (then skipped)

    @property
    def path(self) -> str:
        return f"{self.module}.{self.qualname}"

    @property
    def owner_path(self) -> tuple[str, ...]:  # empty for a module-level target
        return tuple(self.qualname.split(".")[:-1])

    @property
    def attribute(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]


class Bug(str, enum.Enum):
    PRESENT = "present"
    ABSENT = "absent"
    INCONCLUSIVE = "inconclusive"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class Finding:
    """What a reproduction observed: only the bug's own symptom (:func:`symptom`) is ``present``, no other error."""

    present: bool
    detail: str = ""
    skipped: str | None = None  # why the reproduction cannot run here at all (e.g. a Metal-only bug on CPU)
    inconclusive: str | None = None  # the error that is not the bug, as text
    #: For a symptom that is a computed difference (:func:`kvpatch.patches._numbers.judge`): its size, and the rounding
    #: of the backend and dtype it was judged against.
    error: float | None = None
    rounding: float | None = None

    @property
    def bug(self) -> Bug:
        if self.skipped or self.inconclusive:
            return Bug.SKIPPED if self.skipped else Bug.INCONCLUSIVE
        return Bug.PRESENT if self.present else Bug.ABSENT

    @classmethod
    def from_error(cls, exc: BaseException) -> Finding:
        return cls(False, inconclusive=failure(exc))


def symptom(exc: BaseException, *fragments: str) -> str:
    """``str(exc)`` when it carries one of ``fragments`` (the bug's own message); else re-raise ``exc``: an
    unrelated error of the same type makes the finding inconclusive, not "present"."""
    if any(fragment in str(exc) for fragment in fragments):
        return str(exc)
    raise exc


@dataclass(frozen=True)
class Expiry:
    """When a patch must go besides ``Patch.fixed_in``; ``review_by``: when an unfixed one is looked at again."""

    condition: str
    review_by: _dt.date | None = None

    def overdue(self, today: _dt.date | None = None) -> bool:
        return self.review_by is not None and (today or _dt.date.today()) > self.review_by


def borrowed(obj: Any, import_name: str) -> bool:
    """True when ``obj`` is the other upstream's class (mlx-vlm <= 0.6.3 re-exports mlx-lm's batch caches)."""
    top = str(getattr(obj, "__module__", "")).split(".", 1)[0]
    return isinstance(obj, type) and top != import_name and top in DISTRIBUTIONS.values()


def own_class(module: Any, name: str) -> Any:
    """``module``'s class ``name`` where its own distribution defines it, else None (:func:`borrowed`)."""
    cls = getattr(module, name, None)
    return cls if isinstance(cls, type) and not borrowed(cls, module.__name__.split(".", 1)[0]) else None


Builder = Callable[[Any], Any]
Reproduction = Callable[[], Finding]


@dataclass(eq=False)
class Patch:
    """A version-gated fix for one upstream bug in one distribution."""

    id: str
    summary: str
    distribution: str
    affected: str  # PEP 440 range of released versions with the bug, e.g. ``">=0.22.0,<0.24.0"``
    reference: str  # upstream pull request ``owner/repo#N``, or an issue / commit URL
    expiry: Expiry
    fixed_in: str | None = None  # first release with upstream's fix
    fixed_commit: str | None = None  # upstream's fixing commit (hex prefix)
    introduced_commit: str | None = None  # the commit that introduced the bug: git pins before it are out of range
    checked_through: str | None = None  # newest release the bug was measured on
    catalogue: str = ""  # the bug's id(s) in kvpatch's catalogue (e.g. ``A1+A2``), as status shows them
    hot_path: bool = False  # called per token / per layer per step
    order: int = 100  # several patches on one target: lower installs first (innermost)
    metal_only: bool = False  # the bug cannot be observed off Metal
    #: The bug lives in a device's kernels (Metal, CUDA): its reproduction runs on the default device. Every other
    #: reproduction runs on the CPU, so that its verdict is the same on every machine.
    on_device: bool = False
    opt_in: bool = False  # changes documented upstream behaviour (a policy): off unless ``KVPATCH_ENABLE`` names it
    #: Only makes the target compute on a backend: another patch's run without its fix keeps it in place.
    enabler: bool = False
    #: Patches mlx-vlm's own copies of mlx-lm's classes: a target owned by a :func:`borrowed` class is declined.
    own_classes_only: bool = False
    targets: list[Target] = field(default_factory=list)
    builders: dict[Target, Builder] = field(default_factory=dict, repr=False)
    reproduction: Reproduction | None = field(default=None, repr=False)
    #: Run after the patch's changes are taken out: state its replacements keep on upstream's objects goes back.
    restore_hooks: list[Callable[[], None]] = field(default_factory=list, repr=False)
    module: str = ""  # the unit's module (filled by the registry)

    def __post_init__(self) -> None:
        try:
            self.range: SpecifierSet = SpecifierSet(self.affected)
            fixed = Version(self.fixed_in) if self.fixed_in is not None else None
            Version(self.checked_through or "0")
        except ValueError as exc:  # InvalidSpecifier, InvalidVersion
            raise RecordError(f"{self.id}: {exc}") from exc
        if not self.id or self.id != self.id.strip().lower() or any(c in self.id for c in ",*"):
            raise RecordError(f"bad patch id {self.id!r}: use lower-case, no commas or '*'")
        if self.distribution not in DISTRIBUTIONS:
            raise RecordError(f"{self.id}: unknown distribution {self.distribution!r}")
        if fixed is not None and self.range.contains(fixed, prereleases=True):
            raise RecordError(f"{self.id}: fixed_in {self.fixed_in} lies inside {self.affected}")
        if all(spec.operator in (">=", ">", "!=") for spec in self.range):
            # an open range would apply blindly to every future release: newer ones go to the reproduction
            raise RecordError(
                f"{self.id}: affected={self.affected!r} has no upper bound: end it at the newest release measured "
                "('<=X', with checked_through='X'), or before the fixing release ('<X', with fixed_in='X')"
            )
        if fixed is None and self.checked_through is None:
            raise RecordError(f"{self.id}: an unfixed bug needs checked_through (the newest release measured)")

    def _register(self, target: Target) -> Callable[[Builder], Builder]:
        if target in self.builders or target.module.split(".", 1)[0] not in DISTRIBUTIONS.values():
            raise RecordError(f"{self.id}: target {target.path} is declared twice or outside mlx_lm / mlx_vlm")

        def decorate(builder: Builder) -> Builder:
            self.targets.append(target)
            self.builders[target] = builder
            return builder

        return decorate

    def replace(self, module: str, qualname: str, *, optional: bool = False) -> Callable[[Builder], Builder]:
        """Declare that ``builder(original) -> replacement`` changes ``module.qualname`` (returning ``original``
        declines: nothing changes there)."""
        return self._register(Target(module, qualname, Kind.REPLACE, optional))

    def add(self, module: str, qualname: str, *, optional: bool = False) -> Callable[[Builder], Builder]:
        """Declare that ``builder(None) -> attribute`` adds a missing ``module.qualname`` (a function, or a
        ``property`` in front of an instance attribute of that name)."""
        return self._register(Target(module, qualname, Kind.ADD, optional))

    def after_restore(self, func: Callable[[], None]) -> Callable[[], None]:
        self.restore_hooks.append(func)
        return func

    def reproduce(self, func: Reproduction) -> Reproduction:
        if self.reproduction is not None:
            raise RecordError(f"{self.id}: reproduction declared twice")
        self.reproduction = func
        return func

    @property
    def import_name(self) -> str:
        return DISTRIBUTIONS[self.distribution]

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.module for t in self.targets))
