"""Patch records: what a patch is, as plain data plus its fix and its reproduction.

A patch unit in ``kvpatch/patches/`` builds one :class:`Patch` and registers, with decorators,

* one *builder* per target (``@PATCH.replace(module, qualname)`` or ``@PATCH.add(...)``): a
  function that receives the original object (or ``None`` for an added attribute) and returns the
  replacement. Builders run once, at install time; the replacement they return is what runs on
  every call, so it must be a plain function (no wrapper layers, no gating per call);
* one *reproduction* (``@PATCH.reproduce``): a function that exercises the running upstream and
  returns a :class:`Finding` saying whether the bug is present. It is the patch's regression test
  and the judge when the target code has drifted from what the patch was validated against.

Nothing here imports mlx, mlx-lm or mlx-vlm.
"""

from __future__ import annotations

import datetime as _dt
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = [
    "DISTRIBUTIONS",
    "Bug",
    "Expiry",
    "Finding",
    "Kind",
    "Patch",
    "RecordError",
    "Target",
    "borrowed",
    "own_class",
    "symptom",
    "upstream_missing",
]

#: The upstream distributions kvpatch patches, and their import names.
DISTRIBUTIONS: dict[str, str] = {"mlx-lm": "mlx_lm", "mlx-vlm": "mlx_vlm"}


class RecordError(ValueError):
    """A patch record is malformed (raised when the record is built, i.e. by kvpatch's own tests)."""


class Kind(enum.Enum):
    """How a target is changed."""

    REPLACE = "replace"  # the attribute exists; the builder gets it and returns its replacement
    ADD = "add"  # the attribute is missing upstream; the builder returns the new attribute


@dataclass(frozen=True)
class Target:
    """One attribute that a patch changes: ``module`` plus a dotted ``qualname`` inside it."""

    module: str
    qualname: str
    kind: Kind = Kind.REPLACE
    #: A target that may be absent within the affected range (e.g. a class that only exists from a
    #: later release): absence is not an error, the target is skipped.
    optional: bool = False

    @property
    def path(self) -> str:
        return f"{self.module}.{self.qualname}"

    @property
    def owner_path(self) -> tuple[str, ...]:
        """The attribute path of the owner inside the module (empty for module-level targets)."""
        return tuple(self.qualname.split(".")[:-1])

    @property
    def attribute(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]


class Bug(str, enum.Enum):
    """What one reproduction run says of its bug (:attr:`Finding.bug`)."""

    PRESENT = "present"
    ABSENT = "absent"
    INCONCLUSIVE = "inconclusive"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class Finding:
    """What a reproduction observed in the running upstream: present, absent, or inconclusive.

    Only the bug's own symptom is ``present`` (a wrong value, or the exact error the bug raises; see
    :func:`symptom`). Anything else that goes wrong while reproducing (an unrelated error, a kernel
    this backend lacks, an API that moved) says nothing about the bug: the engine turns an exception
    that escapes a reproduction into an *inconclusive* finding, and nothing ever advises a record
    edit on one.
    """

    present: bool
    detail: str = ""
    #: Set when the reproduction declares it cannot run here at all (e.g. a Metal-only bug on CPU).
    skipped: str | None = None
    #: Set when the reproduction ran into something other than the bug (the error, as text).
    inconclusive: str | None = None

    @property
    def bug(self) -> Bug:
        """What the finding says of the bug: present, absent, inconclusive or skipped."""
        if self.skipped:
            return Bug.SKIPPED
        if self.inconclusive:
            return Bug.INCONCLUSIVE
        return Bug.PRESENT if self.present else Bug.ABSENT

    @classmethod
    def from_error(cls, exc: BaseException) -> Finding:
        """The inconclusive finding for an error that is not the bug's own symptom."""
        return cls(False, inconclusive=f"{type(exc).__name__}: {exc}")


def symptom(exc: BaseException, *fragments: str) -> str:
    """``str(exc)`` when it carries one of ``fragments`` (the bug's own error message); else re-raise ``exc``.

    Reproductions catch only the exception type the bug raises and confirm the message with this, so an
    unrelated error of the same type (a missing kernel on another backend, an API change) propagates and
    the finding is inconclusive rather than "present"::

        except ValueError as exc:
            return Finding(True, f"extend then decode raises: {symptom(exc, 'Cannot broadcast')}")
    """
    text = str(exc)
    if any(fragment in text for fragment in fragments):
        return text
    raise exc


@dataclass(frozen=True)
class Expiry:
    """When a patch must go.

    ``fixed_in`` on the patch itself is the primary condition (every supported upstream release at
    or past it); ``review_by`` is a date after which an unfixed patch must be looked at again;
    ``condition`` says in words what retires the patch.
    """

    condition: str
    review_by: _dt.date | None = None

    def overdue(self, today: _dt.date | None = None) -> bool:
        if self.review_by is None:
            return False
        return (today or _dt.date.today()) > self.review_by


def upstream_missing(exc: ImportError) -> bool:
    """True when ``exc`` says an mlx-lm / mlx-vlm module or name is absent from this release.

    Reproductions use it to tell "this release has no such class: nothing to fix" from a missing
    third-party dependency, which must not pass for an absent bug.
    """
    name = getattr(exc, "name", None) or ""
    return name.split(".")[0] in DISTRIBUTIONS.values()


def borrowed(obj: Any, import_name: str) -> bool:
    """True when ``obj`` is a class another upstream distribution defines than ``import_name``'s (mlx-vlm
    0.6.3 and older re-export mlx-lm's batch caches and ``ArraysCache`` from ``mlx_vlm.models.cache``)."""
    if not isinstance(obj, type):
        return False
    top = str(getattr(obj, "__module__", "")).split(".", 1)[0]
    return top != import_name and top in DISTRIBUTIONS.values()


def own_class(module: Any, name: str) -> Any:
    """``module``'s class ``name`` where ``module``'s own distribution defines it; None where it is absent or
    another distribution's (see :func:`borrowed`)."""
    cls = getattr(module, name, None)
    if not isinstance(cls, type) or borrowed(cls, module.__name__.split(".", 1)[0]):
        return None
    return cls


Builder = Callable[[Any], Any]
Reproduction = Callable[[], Finding]


@dataclass(eq=False)
class Patch:
    """A version-gated fix for one upstream bug in one distribution."""

    id: str
    summary: str
    distribution: str
    #: PEP 440 range of *released* versions that have the bug, e.g. ``">=0.22.0,<0.24.0"``.
    affected: str
    #: Upstream reference: a pull request ``owner/repo#N`` or an issue/commit URL.
    reference: str
    expiry: Expiry
    #: First release that carries upstream's fix, or ``None`` when upstream has not fixed it.
    fixed_in: str | None = None
    #: Upstream commit that fixed the bug (hex prefix), if any.
    fixed_commit: str | None = None
    #: Upstream commit that introduced the bug, if known: git pins before it are out of range.
    introduced_commit: str | None = None
    #: Newest upstream release on which the bug was measured (for unfixed bugs: "not fixed as of").
    checked_through: str | None = None
    #: Catalogue id(s) of the bug in kvpatch's bug catalogue (e.g. ``A1+A2``), as the status report shows them.
    catalogue: str = ""
    #: Called per token / per layer per step: the replacement must be a plain function.
    hot_path: bool = False
    #: Composition order when several patches change one target: lower installs first (innermost).
    order: int = 100
    #: True when the bug cannot be observed on this backend (e.g. Metal-only kernels).
    metal_only: bool = False
    #: True when the fix changes documented upstream behaviour (a policy, not a bug fix): the patch is
    #: off unless ``KVPATCH_ENABLE`` names it (see :mod:`kvpatch.config`).
    opt_in: bool = False
    #: True for a patch that only makes the target compute on a backend (the same result by a path the
    #: backend computes correctly): another patch's "without" run in ``status --verify`` keeps it in place,
    #: since without it that reproduction cannot run at all there (its own verify still takes it out).
    #: Example: qsdpa-cuda-shapes (dequantized attention where CUDA's quantized products fail).
    enabler: bool = False
    #: True for a patch of mlx-vlm's own copies of mlx-lm's classes: a target whose owner class is another
    #: distribution's (:func:`borrowed`, looked up when the target is installed) is left alone, as a builder
    #: that declines leaves it; that class is the other distribution's twin patch's.
    own_classes_only: bool = False
    targets: list[Target] = field(default_factory=list)
    builders: dict[Target, Builder] = field(default_factory=dict, repr=False)
    reproduction: Reproduction | None = field(default=None, repr=False)
    #: Called (no arguments) each time the patch's changes have been taken out (deactivate, ``without``, a
    #: verification's unpatched run): a patch whose replacements keep state on upstream's objects in a form
    #: only they read (arrays-advance-detach's deferred metadata) puts it back in upstream's form here.
    restore_hooks: list[Callable[[], None]] = field(default_factory=list, repr=False)
    #: The module that defines the patch (filled by the registry).
    module: str = ""

    def __post_init__(self) -> None:
        if not self.id or self.id != self.id.strip().lower() or "," in self.id or "*" in self.id:
            raise RecordError(f"bad patch id {self.id!r}: use lower-case, no commas or '*'")
        if self.distribution not in DISTRIBUTIONS:
            raise RecordError(f"{self.id}: unknown distribution {self.distribution!r}")
        try:
            self.range: SpecifierSet = SpecifierSet(self.affected)
        except InvalidSpecifier as exc:
            raise RecordError(f"{self.id}: bad affected range {self.affected!r}: {exc}") from exc
        for name in ("fixed_in", "checked_through"):
            value = getattr(self, name)
            if value is not None:
                try:
                    Version(value)
                except InvalidVersion as exc:
                    raise RecordError(f"{self.id}: bad {name} {value!r}") from exc
        if self.fixed_in is not None and self.range.contains(self.fixed_in, prereleases=True):
            raise RecordError(f"{self.id}: fixed_in {self.fixed_in} lies inside {self.affected}")
        if not any(spec.operator in ("<", "<=", "==", "~=", "===") for spec in self.range):
            # An open range would apply blindly to every future release: a range ends at the fix, or
            # (unfixed) at the newest release measured, and newer releases go to the reproduction.
            raise RecordError(f"{self.id}: affected range {self.affected!r} has no upper bound")
        if self.fixed_in is None and self.checked_through is None:
            raise RecordError(f"{self.id}: an unfixed bug needs checked_through (the newest release measured)")

    @property
    def specifier(self) -> SpecifierSet:
        """``affected`` as a ``packaging`` SpecifierSet (the maintenance tools' name for :attr:`range`)."""
        return self.range

    # -- declaration helpers used by patch modules ------------------------------------------
    def _register(self, target: Target) -> Callable[[Builder], Builder]:
        if target in self.builders:
            raise RecordError(f"{self.id}: target {target.path} declared twice")
        package = target.module.split(".", 1)[0]
        if package not in DISTRIBUTIONS.values():
            raise RecordError(f"{self.id}: target {target.path} is outside mlx_lm / mlx_vlm")

        def decorate(builder: Builder) -> Builder:
            self.targets.append(target)
            self.builders[target] = builder
            return builder

        return decorate

    def replace(self, module: str, qualname: str, *, optional: bool = False) -> Callable[[Builder], Builder]:
        """Declare that ``builder(original) -> replacement`` changes ``module.qualname``.

        A builder that returns ``original`` itself declines: nothing is changed for that target.
        """
        return self._register(Target(module, qualname, Kind.REPLACE, optional))

    def add(self, module: str, qualname: str, *, optional: bool = False) -> Callable[[Builder], Builder]:
        """Declare that ``builder(None) -> attribute`` adds a missing ``module.qualname`` (a function, or a
        ``property`` on a class: a data descriptor in front of an instance attribute of that name)."""
        return self._register(Target(module, qualname, Kind.ADD, optional))

    def after_restore(self, func: Callable[[], None]) -> Callable[[], None]:
        """Declare a hook run after the patch's changes are taken out (see :attr:`restore_hooks`)."""
        self.restore_hooks.append(func)
        return func

    def reproduce(self, func: Reproduction) -> Reproduction:
        """Declare the reproduction (one per patch)."""
        if self.reproduction is not None:
            raise RecordError(f"{self.id}: reproduction declared twice")
        self.reproduction = func
        return func

    # -- derived facts ------------------------------------------------------------------------
    @property
    def import_name(self) -> str:
        return DISTRIBUTIONS[self.distribution]

    @property
    def modules(self) -> tuple[str, ...]:
        """Target modules, in declaration order, without repeats."""
        return tuple(dict.fromkeys(t.module for t in self.targets))

    @property
    def fixed_text(self) -> str:
        if self.fixed_in:
            commit = f" ({self.fixed_commit})" if self.fixed_commit else ""
            return f"{self.fixed_in}{commit}"
        if self.checked_through:
            return f"not fixed as of {self.checked_through}"
        return "not fixed"
