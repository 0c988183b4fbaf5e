"""Find out which upstream releases are installed, and from where, without importing them.

Versions come from ``importlib.metadata``; the install source from the PEP 610
``direct_url.json`` that pip writes into a distribution's ``.dist-info`` for VCS, local-directory
(editable or not) and archive installs. A plain install from an index has no such file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import metadata

__all__ = ["Source", "Upstream", "detect", "detect_one", "read_source"]

#: What status reports on: the array library and the two patched distributions.
WATCHED = ("mlx", "mlx-lm", "mlx-vlm")


@dataclass(frozen=True)
class Source:
    """Where a distribution was installed from (PEP 610)."""

    #: ``index`` (no direct_url.json), ``vcs``, ``editable``, ``directory``, ``archive``,
    #: or ``unknown`` (direct_url.json present but unreadable or of an unknown form).
    kind: str = "index"
    url: str | None = None
    vcs: str | None = None
    commit: str | None = None
    requested_revision: str | None = None
    #: Why the direct_url.json could not be used, when ``kind == "unknown"``.
    error: str | None = None

    def describe(self) -> str:
        if self.kind == "index":
            return "package index"
        if self.kind == "vcs":
            rev = f"@{self.commit[:12]}" if self.commit else ""
            return f"{self.vcs or 'vcs'} {self.url}{rev}"
        if self.kind == "unknown":
            return f"unknown source ({self.error})"
        return f"{self.kind} {self.url}"


@dataclass(frozen=True)
class Upstream:
    """One installed (or absent) distribution."""

    name: str
    version: str | None
    source: Source = Source()
    location: str | None = None

    @property
    def installed(self) -> bool:
        return self.version is not None

    @property
    def commit(self) -> str | None:
        return self.source.commit

    def describe(self) -> str:
        if not self.installed:
            return "not installed"
        return f"{self.version} ({self.source.describe()})"


def read_source(text: str | None) -> Source:
    """Parse the text of a ``direct_url.json`` (``None``: the file is absent)."""
    if text is None:
        return Source()
    try:
        data = json.loads(text)
    except ValueError as exc:
        return Source(kind="unknown", error=f"direct_url.json is not JSON: {exc}")
    if not isinstance(data, dict) or not isinstance(data.get("url"), str):
        return Source(kind="unknown", error="direct_url.json has no 'url'")
    url = data["url"]
    vcs_info = data.get("vcs_info")
    if isinstance(vcs_info, dict):
        commit = vcs_info.get("commit_id")
        if commit is not None and not (isinstance(commit, str) and _is_hex(commit)):
            return Source(kind="unknown", url=url, error=f"vcs_info.commit_id {commit!r} is not a hex id")
        return Source(
            kind="vcs",
            url=url,
            vcs=str(vcs_info.get("vcs") or "git"),
            commit=commit.lower() if commit else None,
            requested_revision=vcs_info.get("requested_revision"),
        )
    dir_info = data.get("dir_info")
    if isinstance(dir_info, dict):
        return Source(kind="editable" if dir_info.get("editable") else "directory", url=url)
    if isinstance(data.get("archive_info"), dict):
        return Source(kind="archive", url=url)
    return Source(kind="unknown", url=url, error="direct_url.json has none of vcs_info, dir_info, archive_info")


def _is_hex(text: str) -> bool:
    return 4 <= len(text) <= 64 and all(c in "0123456789abcdefABCDEF" for c in text)


def detect_one(name: str) -> Upstream:
    """Detect one distribution; never raises."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return Upstream(name, None)
    except Exception as exc:  # a broken .dist-info must not break the user's program
        return Upstream(name, None, Source(kind="unknown", error=f"metadata unreadable: {exc}"))
    version = dist.version
    try:
        text = dist.read_text("direct_url.json")
    except Exception as exc:
        source = Source(kind="unknown", error=f"direct_url.json unreadable: {exc}")
    else:
        source = read_source(text)
    location: str | None
    try:
        location = str(dist.locate_file(""))
    except Exception:
        location = None
    return Upstream(name, version or None, source, location)


def detect(names: tuple[str, ...] = WATCHED) -> dict[str, Upstream]:
    """Detect every watched distribution (reads metadata only; imports nothing of upstream)."""
    return {name: detect_one(name) for name in names}
