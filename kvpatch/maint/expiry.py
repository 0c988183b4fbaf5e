"""When a patch must go: expiry evaluated from the records alone (nothing of upstream is imported).

A patch expires when

(a) every supported upstream release carries upstream's fix: its ``fixed_in`` is at or below
    :data:`SUPPORTED_FLOOR` for its distribution (the oldest release the test matrix runs,
    defined by :mod:`kvpatch.maint.matrix`). The patch can no longer apply to any release
    kvpatch supports: delete its module and list it in :mod:`kvpatch.maint.retired`;
(b) its ``Expiry.review_by`` date has passed: someone must look at it again (re-run
    ``python -m kvpatch upstream-check``, then retire it or move the date);
(c) its reproduction no longer reproduces on the newest upstream release: that is measured, not read
    from the record, by ``python -m kvpatch upstream-check`` (which then asks for ``fixed_in``, after
    which (a) takes over once the floor reaches it).

Users only ever see warnings (:func:`warn`). ``KVPATCH_ENFORCE=1`` (set in kvpatch's CI, never by
default) makes an overdue review-by date fail kvpatch's own test suite; an (a) expiry fails it always,
since such a patch is dead code. ``status --check`` lists every reason (:func:`expiry_reasons`).
"""

from __future__ import annotations

import datetime as _dt
import enum
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from packaging.version import Version

from ..record import Patch
from ..registry import module_for
from .matrix import SUPPORTED_FLOOR

__all__ = [
    "SUPPORTED_FLOOR",
    "Expired",
    "Reason",
    "evaluate",
    "expired",
    "expiry_reasons",
    "failing",
    "patch_file",
    "warn",
]


class Reason(enum.Enum):
    FIXED_EVERYWHERE = "fixed in every supported release"
    REVIEW_BY = "review-by date passed"


@dataclass(frozen=True)
class Expired:
    patch_id: str
    file: str
    reason: Reason
    message: str

    @property
    def always_fails(self) -> bool:
        """An (a) expiry fails kvpatch's own tests always; a review-by date only under KVPATCH_ENFORCE=1."""
        return self.reason is Reason.FIXED_EVERYWHERE


def patch_file(patch: Patch) -> str:
    """The patch module's path in the repository (``kvpatch/patches/mlx_lm/mask_fill.py``)."""
    return (patch.module or module_for(patch.id, patch.distribution)).replace(".", "/") + ".py"


def evaluate(patch: Patch, today: _dt.date | None = None, floor: Mapping[str, str] | None = None) -> list[Expired]:
    """Every expiry reason that holds for ``patch`` on ``today`` (default: today)."""
    floor = SUPPORTED_FLOOR if floor is None else floor
    today = today or _dt.date.today()
    where = patch_file(patch)
    out: list[Expired] = []
    oldest = floor.get(patch.distribution)
    if patch.fixed_in is not None and oldest is not None and Version(patch.fixed_in) <= Version(oldest):
        out.append(
            Expired(
                patch.id,
                where,
                Reason.FIXED_EVERYWHERE,
                f"{patch.id}: expired: every supported {patch.distribution} release (>= {oldest}, the oldest in "
                f"kvpatch/maint/matrix.py) has upstream's fix (fixed_in {patch.fixed_in}): delete {where}, add it to "
                "RETIRED in kvpatch/maint/retired.py, and run `python -m kvpatch.maint.regenerate`",
            )
        )
    review_by = patch.expiry.review_by
    if review_by is not None and patch.expiry.overdue(today):
        out.append(
            Expired(
                patch.id,
                where,
                Reason.REVIEW_BY,
                f"{patch.id}: review-by date {review_by.isoformat()} has passed ({patch.expiry.condition}): run "
                f"`python -m kvpatch upstream-check` and do what it names (set fixed_in, or bump checked_through and "
                f"affected), then set a later Expiry(review_by=...) in {where} and run "
                "`python -m kvpatch.maint.regenerate` (COMPAT.md shows the date)",
            )
        )
    return out


def expired(
    patches: Iterable[Patch], today: _dt.date | None = None, floor: Mapping[str, str] | None = None
) -> list[Expired]:
    return [e for p in patches for e in evaluate(p, today, floor)]


def expiry_reasons(patches: Iterable[Patch], today: _dt.date | None = None) -> list[str]:
    """One line per expiry reason, for ``status --check`` (each names the file to change)."""
    return [e.message for e in expired(patches, today)]


def failing(patches: Iterable[Patch], *, enforce: bool, today: _dt.date | None = None) -> list[Expired]:
    """The expiries that fail kvpatch's own test run: (a) always, review-by dates when ``enforce``."""
    return [e for e in expired(patches, today) if e.always_fails or enforce]


def warn(patches: Iterable[Patch], today: _dt.date | None = None) -> list[Expired]:
    """Warn (:class:`kvpatch.KvpatchWarning`) once per expiry; never raises. Returns them."""
    from .._warn import KvpatchWarning

    found = expired(patches, today)
    for e in found:
        warnings.warn(e.message, KvpatchWarning, stacklevel=2)
    return found
