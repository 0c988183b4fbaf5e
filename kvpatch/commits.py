"""Place a git-pinned upstream commit against a bug's fixing and introducing commits, from the shipped index of
each upstream's first-parent main line (``kvpatch/data/commits-<dist>.txt``): a side-branch commit takes its merge's
position; a pin not in the index is unknown. Release tags are not read (upstream tags and PyPI wheels disagree)."""

from __future__ import annotations

import functools
from bisect import bisect_left
from dataclasses import dataclass, field
from datetime import datetime
from importlib import resources

MIN_PREFIX = 7  # shortest commit prefix accepted by CommitIndex.resolve
_HEX = frozenset("0123456789abcdef")
_FULL = 40  # length of a full (SHA-1) commit id
_SHORT = 8  # length of commit ids in human-readable reasons


@dataclass(frozen=True, eq=False)
class CommitIndex:
    """Main-line history of one upstream; a commit is a full id or a unique hex prefix of :data:`MIN_PREFIX`+."""

    distribution: str
    head: str  # full id of the newest indexed main-line commit
    generated: datetime  # committer date of ``head`` (UTC)
    mainline: tuple[str, ...]  # main-line commits, oldest first
    _position: dict[str, int] = field(repr=False)  # every indexed commit -> main-line position
    _prs: dict[int, int] = field(repr=False)  # main-line position -> pull-request number

    @classmethod
    def parse(cls, text: str, distribution: str = "") -> CommitIndex:
        header: dict[str, str] = {}
        mainline: list[str] = []
        position: dict[str, int] = {}
        prs: dict[int, int] = {}
        for line in filter(None, text.splitlines()):
            if line[0] == "#":
                key, sep, value = line[2:].partition(": ")
                if sep and key in ("distribution", "head", "generated"):
                    header[key] = value.strip()
            elif line[0] == "+":
                position[line[1 : _FULL + 1]] = len(mainline) - 1
            else:
                sha, _, rest = line.partition(" ")
                position[sha] = len(mainline)
                prs.update((len(mainline), int(word[1:])) for word in rest.split() if word[0] == "#")
                mainline.append(sha)
        if header.get("head", mainline[-1]) != mainline[-1]:
            raise ValueError(f"commit index: header head {header['head']} is not the last main-line commit")
        generated = datetime.fromisoformat(header["generated"])
        return cls(header.get("distribution", distribution), mainline[-1], generated, tuple(mainline), position, prs)

    @functools.cached_property
    def _sorted(self) -> list[str]:
        return sorted(self._position)

    def resolve(self, commit_or_prefix: str) -> str | None:
        """Full id of an indexed commit, or None (unknown, too short, not hex, or ambiguous)."""
        key = commit_or_prefix.strip().lower()
        if not MIN_PREFIX <= len(key) <= _FULL or not _HEX.issuperset(key):
            return None
        i = bisect_left(self._sorted, key)
        found = [c for c in self._sorted[i : i + 2] if c.startswith(key)]
        return found[0] if len(found) == 1 else None  # none, or ambiguous

    def contains(self, pinned: str, fix_commit: str) -> bool | None:
        """Whether the tree at ``pinned`` contains ``fix_commit`` (None: unknown). A pin on a merged side branch
        is decided only when the fix came in after its merge (False) or is the pin itself (True)."""
        pin, fix = self.resolve(pinned), self.resolve(fix_commit)
        if pin is None or fix is None:
            return None
        pin_pos, fix_pos = self._position[pin], self._position[fix]
        if self.mainline[pin_pos] == pin:
            return pin_pos >= fix_pos
        if pin == fix:
            return True
        # A side commit is an ancestor of its merge: anything merged later can't be in it.
        return False if fix_pos > pin_pos else None

    def describe(self, commit: str) -> str:
        """``2a55b80b (#1208)``, ``570afed3 (merged by c8d6057c, #1890)``; an unknown commit as given."""
        full = self.resolve(commit)
        if full is None:
            return commit.strip()
        pos = self._position[full]
        notes = [f"merged by {self.mainline[pos][:_SHORT]}"] if self.mainline[pos] != full else []
        notes += [f"#{self._prs[pos]}"] if pos in self._prs else []
        return f"{full[:_SHORT]} ({', '.join(notes)})" if notes else full[:_SHORT]


@functools.cache
def load_index(distribution: str) -> CommitIndex:
    text = resources.files("kvpatch.data").joinpath(f"commits-{distribution}.txt").read_text(encoding="ascii")
    return CommitIndex.parse(text, distribution)


@dataclass(frozen=True)
class Placement:
    """Where a pinned commit stands relative to a bug's introducing and fixing commits (what the gate reads)."""

    known: bool  # the pin is in kvpatch's index
    fixed: bool | None  # the pin contains the fix; None: not asked, or the index can't tell
    introduced: bool | None  # the pin contains the bug's introduction; None: not asked, or can't tell
    reason: str  # one line, for humans


def place(
    distribution: str, pinned: str, *, fixed_commit: str | None = None, introduced_commit: str | None = None
) -> Placement:
    """Place ``pinned`` against a bug's fixing and introducing commits; what the index cannot tell is None."""
    index = load_index(distribution)
    stamp = f"generated {index.generated:%Y-%m-%d} from head {index.head[:7]}"
    pin = index.resolve(pinned)
    if pin is None:
        why = f"commit {pinned.strip()} is not on {distribution}'s main line in kvpatch's index ({stamp})"
        return Placement(False, None, None, f"{why}; the reproduction decides")
    fix = index.resolve(fixed_commit) if fixed_commit is not None else None
    intro = index.resolve(introduced_commit) if introduced_commit is not None else None
    for given, full, what in ((fixed_commit, fix, "fix"), (introduced_commit, intro, "bug-introducing commit")):
        if given is not None and full is None:
            why = f"the {what} {given.strip()} is not in kvpatch's index of {distribution} ({stamp})"
            return Placement(True, None, None, f"{why}; the reproduction decides")

    pin_pos = index._position[pin]
    fixed = index.contains(pin, fix) if fix is not None else None
    introduced = index.contains(pin, intro) if intro is not None else None
    subject = f"pinned commit {pin[:_SHORT] if index.mainline[pin_pos] == pin else index.describe(pin)}"
    clauses: list[str] = []
    if intro is not None and introduced is not None:
        when = "at or after the bug's introduction in" if introduced else "before the bug was introduced in"
        clauses.append(f"{when} {index.describe(intro)}")
    if fix is not None and fixed is not None and introduced is not False:
        clauses.append(f"{'at or after' if fixed else 'before'} the fix {index.describe(fix)}")
    undecided = (fix is not None and fixed is None) or (intro is not None and introduced is None)
    if undecided and introduced is not False and fixed is not True:
        targets = " / ".join(index.describe(c) for c in (intro, fix) if c is not None)
        reason = f"{subject} can't be ordered against {targets} from kvpatch's index; the reproduction decides"
    elif clauses:
        reason = f"{subject} is " + " and ".join(clauses)
    else:  # nothing to place against (the gate then reads the version the checkout declares)
        reason = f"{subject} is on {distribution}'s main line at position {pin_pos}"
    return Placement(True, fixed, introduced, reason)
