"""Plain release versions and simple ranges without ``packaging``, for the path every import of mlx-lm takes.

Importing ``packaging.specifiers`` (its regular expressions compiled at import) and parsing the versions of
every applicable record cost a few milliseconds of each user's ``import mlx_lm``. Almost always the installed
upstream is a plain release (``0.32.2``) and the records' ranges are plain clauses (``>=0.30.4,<=0.32.2``):
for those, PEP 440 reduces to comparing tuples of integers (padded with zeros), which this module does.
Anything else (pre-, post-, dev- and local versions, epochs, ``~=``, ``===``, wildcards) goes to
``packaging``, imported then. ``tests/engine/test_versions.py`` holds both to the same answers.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

__all__ = ["Range", "Release", "affected_range", "parse", "parse_range", "release"]

#: A canonical plain release: what ``str(packaging.version.Version(text))`` gives back unchanged.
_RELEASE = re.compile(r"(?:0|[1-9][0-9]*)(?:\.(?:0|[1-9][0-9]*))*\Z")
_CLAUSE = re.compile(r"\s*(>=|<=|==|!=|<|>)\s*((?:0|[1-9][0-9]*)(?:\.(?:0|[1-9][0-9]*))*)\s*\Z")


class Release:
    """A plain release version (``N(.N)*``): ``packaging.version.Version``'s attributes the gate reads."""

    __slots__ = ("_key", "_text", "release")
    local = None
    is_prerelease = False
    is_devrelease = False

    def __init__(self, text: str) -> None:
        self._text = text
        self.release = tuple(int(part) for part in text.split("."))
        key = self.release
        while len(key) > 1 and key[-1] == 0:  # 1.2.0 == 1.2
            key = key[:-1]
        self._key = key

    @property
    def public(self) -> str:
        return self._text

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        return f"<Release({self._text!r})>"

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Release) and self._key == other._key

    def __lt__(self, other: Release) -> bool:
        return self._key < other._key

    def __le__(self, other: Release) -> bool:
        return self._key <= other._key

    def __gt__(self, other: Release) -> bool:
        return self._key > other._key

    def __ge__(self, other: Release) -> bool:
        return self._key >= other._key


def release(text: str) -> Release | None:
    """``text`` as a :class:`Release`, or None when it is not a canonical plain release."""
    return Release(text) if _RELEASE.match(text) else None


def parse(text: str) -> Any:
    """A :class:`Release` for a plain release, else ``packaging.version.Version(text)`` (which raises
    ``packaging.version.InvalidVersion``, a ``ValueError``, for text that is not PEP 440)."""
    plain = release(text)
    if plain is not None:
        return plain
    from packaging.version import Version

    return Version(text)


def full(version: Any) -> Any:
    """``version`` as a ``packaging.version.Version`` (a :class:`Release` converted, anything else as it is)."""
    if isinstance(version, Release):
        from packaging.version import Version

        return Version(str(version))
    return version


_TESTS = {
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}


class _Clause:
    """One ``<op><release>`` clause: what the gate reads of a ``packaging.specifiers.Specifier``."""

    __slots__ = ("operator", "version")

    def __init__(self, operator: str, version: Release) -> None:
        self.operator = operator
        self.version = version

    def contains(self, item: Any, prereleases: bool | None = None) -> bool:
        if isinstance(item, str):
            item = parse(item)
        if not isinstance(item, Release):
            from packaging.specifiers import Specifier

            return Specifier(str(self)).contains(item, prereleases=prereleases)
        return bool(_TESTS[self.operator](item, self.version))

    def __str__(self) -> str:
        return f"{self.operator}{self.version}"


class Range:
    """A range of plain clauses, e.g. ``>=0.30.4,<=0.32.2``: what the gate reads of a ``SpecifierSet``.

    For a plain release and plain clauses, PEP 440's answer does not depend on ``prereleases`` (it only
    concerns pre-releases), so the argument is accepted and ignored there; any other version goes to
    ``packaging``.
    """

    __slots__ = ("_clauses", "_text")

    def __init__(self, text: str, clauses: list[_Clause]) -> None:
        self._text = text
        self._clauses = clauses

    def __iter__(self) -> Iterator[_Clause]:
        return iter(self._clauses)

    def __len__(self) -> int:
        return len(self._clauses)

    def __str__(self) -> str:
        return ",".join(sorted(str(c) for c in self._clauses))

    def contains(self, item: Any, prereleases: bool | None = None) -> bool:
        if isinstance(item, str):
            item = parse(item)
        if not isinstance(item, Release):
            from packaging.specifiers import SpecifierSet

            return SpecifierSet(self._text).contains(item, prereleases=prereleases)
        return all(c.contains(item) for c in self._clauses)

    def __contains__(self, item: Any) -> bool:
        return self.contains(item)


def parse_range(text: str) -> Range | None:
    """``text`` as a :class:`Range` when every comma-separated clause is ``<op><plain release>`` with
    ``op`` in ``>= <= > < == !=``; None otherwise (``packaging`` then)."""
    clauses = []
    for part in text.split(","):
        match = _CLAUSE.match(part)
        if match is None:
            return None
        clauses.append(_Clause(match.group(1), Release(match.group(2))))
    return Range(text, clauses)


def affected_range(text: str) -> Any:
    """A record's ``affected`` range as the gate reads it: a :class:`Range` when it is plain, else a
    ``packaging`` SpecifierSet (which raises ``InvalidSpecifier``, a ``ValueError``, for a malformed one)."""
    plain = parse_range(text)
    if plain is not None:
        return plain
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(text)
