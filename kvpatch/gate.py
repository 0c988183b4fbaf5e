"""The gate: a pure function from (patch, detected upstream, config) to a decision with a reason. It imports
nothing of upstream, so it is tested table-driven."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from packaging.version import InvalidVersion, Version

if TYPE_CHECKING:
    from .config import Config
    from .detect import Upstream
    from .record import Patch
    from .registry import Stub


class Action(enum.Enum):
    APPLY = "apply"
    VERIFY = "verify"  # the facts do not settle it: the reproduction decides
    NOT_NEEDED = "not needed"
    OUT_OF_RANGE = "out of range"
    NOT_INSTALLED = "not installed"
    DISABLED = "disabled"
    OPT_IN = "opt-in"  # changes documented upstream behaviour and was not asked for (``KVPATCH_ENABLE``)


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str


def _verify(why: str, sep: str = "; ") -> Decision:
    return Decision(Action.VERIFY, f"{why}{sep}the reproduction decides")


def decide(patch: Patch | Stub, upstream: Upstream, config: Config) -> Decision:
    if not config.enabled:
        return Decision(Action.DISABLED, "kvpatch is off (KVPATCH=off)")
    if config.is_disabled(patch.id):
        how = "KVPATCH_DISABLE=*" if config.disable_all else f"KVPATCH_DISABLE names {patch.id}"
        return Decision(Action.DISABLED, f"disabled by {how}")
    if not upstream.installed:
        return Decision(Action.NOT_INSTALLED, f"{patch.distribution} is not installed")
    decision = _decide_installed(patch, upstream)
    if patch.opt_in and decision.action in (Action.APPLY, Action.VERIFY) and not config.is_opted_in(patch.id):
        why = "this patch changes documented upstream behaviour, so it is off unless asked for"
        return Decision(Action.OPT_IN, f"{decision.reason}; {why}: KVPATCH_ENABLE={patch.id}")
    return decision


def _pinned(patch: Patch | Stub, dist: str, commit: str) -> Decision | None:
    """A git pin placed against the fixing and introducing commits; None: nothing to place against."""
    from .commits import place  # the commit index loads only for a git pin

    short = commit[:8]
    try:
        placement = place(dist, commit, fixed_commit=patch.fixed_commit, introduced_commit=patch.introduced_commit)
    except Exception as exc:  # a broken index must not stop the user's program
        return _verify(f"{dist} commit {short}: commit index unusable ({exc})")
    if not placement.known:
        return Decision(Action.VERIFY, placement.reason)
    if placement.fixed:
        return Decision(Action.NOT_NEEDED, f"pinned {dist} commit {short} contains the fix: {placement.reason}")
    if placement.introduced is False:
        return Decision(Action.OUT_OF_RANGE, f"pinned {dist} commit {short} predates the bug: {placement.reason}")
    if patch.fixed_in and not patch.fixed_commit:
        why = f"upstream's fix ({patch.fixed_in}) has no public commit to place it against"
        return _verify(f"{dist} commit {short}: {why}")
    if (patch.fixed_commit and placement.fixed is None) or (patch.introduced_commit and placement.introduced is None):
        return Decision(Action.VERIFY, f"{dist} commit {short} cannot be ordered against the fix: {placement.reason}")
    if patch.fixed_commit or patch.introduced_commit:
        return Decision(Action.APPLY, f"pinned {dist} commit {short} has the bug: {placement.reason}")
    return None  # the gate reads the version the checkout declares


def _decide_installed(patch: Patch | Stub, upstream: Upstream) -> Decision:
    dist = patch.distribution
    source = upstream.source
    if source.kind == "unknown" and upstream.version is not None:
        return _verify(f"{dist} install source unknown ({source.error})")
    if source.kind == "vcs" and source.commit and (decision := _pinned(patch, dist, source.commit)) is not None:
        return decision
    if upstream.version is None:  # no version in the metadata, or a git pin the commit index could not place
        why = upstream.version_unknown or "no version in its metadata"
        return _verify(f"{dist} is installed, version unknown ({why})", ": ")
    try:
        version = Version(upstream.version)
    except InvalidVersion:
        return _verify(f"{dist} version {upstream.version!r} is not PEP 440")

    where = "" if source.kind in ("index", "vcs") else f" ({source.kind} install: its code may differ from the release)"
    public = Version(version.public)
    fixed = Version(patch.fixed_in) if patch.fixed_in else None
    if fixed is not None and where and public.release == fixed.release:
        # A source tree declares the coming release before the fix has necessarily landed in it.
        return _verify(f"{dist} {version} is the fixing release {patch.fixed_in} as a {source.kind} install")
    if fixed is not None and public >= fixed:
        return Decision(Action.NOT_NEEDED, f"{dist} {version} >= {patch.fixed_in}, which fixed it{where}")
    if fixed is not None and public.release == fixed.release and (public.is_prerelease or public.is_devrelease):
        return _verify(f"{dist} {version} is a pre-release of {patch.fixed_in} (the fixing release)")
    if patch.range.contains(public, prereleases=True):
        if where:
            return _verify(f"{dist} {version} is in {patch.affected}{where}")
        local = f" (local build {version})" if version.local else ""
        return Decision(Action.APPLY, f"{dist} {version}{local} is in the affected range {patch.affected}")
    if any(spec.operator in (">=", ">") and not spec.contains(public, prereleases=True) for spec in patch.range):
        return Decision(Action.OUT_OF_RANGE, f"{dist} {version} predates the affected range {patch.affected}")
    if fixed is None:  # a record without fixed_in has checked_through
        return _verify(f"{dist} {version} is newer than {patch.checked_through} (not fixed as of then)")
    return _verify(f"{dist} {version} lies between the affected range {patch.affected} and the fix {patch.fixed_in}")


#: :func:`misplaced`'s answers that are not one record field.
LOWER_BOUND = "lower bound of affected"
PINNED = "introduced_commit or fixed_commit"


def misplaced(patch: Patch, version: str | None, commit: str | None, says: Action) -> str:
    """The record field a finding on upstream's own code contradicts, by where ``version`` (installed from git
    ``commit``, if given) sits in the record (CONTRIBUTING.md, "The record"), which ``says`` the release has the fix
    (``NOT_NEEDED``) or predates the bug (``OUT_OF_RANGE``) while the bug is there, or has it (``APPLY``) while it is
    absent: then the range's lower bound, its upper end (``fixed_in``) or a gap in ``affected``."""
    if says is Action.NOT_NEEDED:
        return "fixed_commit" if commit else "fixed_in"
    if says is Action.OUT_OF_RANGE:
        return "introduced_commit" if commit else LOWER_BOUND
    if commit:
        return PINNED
    try:
        release = Version(version or "")
        ends = {Version(s.version) for s in patch.range if s.operator in ("<=", "<")}
        ends |= {Version(patch.checked_through)} if patch.checked_through else set()
    except InvalidVersion:
        return "affected"
    if any(s.operator in (">=", ">") and Version(s.version) == release for s in patch.range):
        return LOWER_BOUND
    return "fixed_in" if release in ends else "affected"
