"""Which upstream releases are installed, and from where (PEP 610's ``direct_url.json``), without importing them
(``PathFinder`` is asked directly: no finder on ``sys.meta_path`` runs). Importable without a version in its
metadata: *installed, version unknown*, for the reproduction."""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from importlib import metadata
from importlib.machinery import PathFinder

from ._warn import failure

#: The array library and the patched distributions: the module that shows each is importable (``mlx`` is a namespace).
PROBES: dict[str, str] = {"mlx": "mlx.core", "mlx-lm": "mlx_lm", "mlx-vlm": "mlx_vlm"}


@dataclass(frozen=True)
class Source:
    """Where a distribution was installed from (PEP 610)."""

    #: index (no direct_url.json), vcs, editable, directory, archive, unknown (unusable, no metadata), none (absent)
    kind: str = "index"
    url: str | None = None
    commit: str | None = None
    error: str | None = None  # why, when ``kind == "unknown"``


NOT_INSTALLED = Source(kind="none")


@dataclass(frozen=True)
class Upstream:
    name: str
    version: str | None
    source: Source = Source()
    location: str | None = None
    version_unknown: str | None = None  # why no version although the package is importable

    @property
    def installed(self) -> bool:
        return self.version is not None or self.version_unknown is not None


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
    if isinstance(vcs_info := data.get("vcs_info"), dict):
        commit = vcs_info.get("commit_id")
        if commit is not None and not (isinstance(commit, str) and re.fullmatch("[0-9a-fA-F]{4,64}", commit)):
            return Source(kind="unknown", url=url, error=f"vcs_info.commit_id {commit!r} is not a hex id")
        return Source("vcs", url, commit.lower() if commit else None)
    if isinstance(dir_info := data.get("dir_info"), dict):
        return Source(kind="editable" if dir_info.get("editable") else "directory", url=url)
    if isinstance(data.get("archive_info"), dict):
        return Source(kind="archive", url=url)
    return Source(kind="unknown", url=url, error="direct_url.json has none of vcs_info, dir_info, archive_info")


def detect_one(name: str) -> Upstream:
    """Detect one distribution; never raises (a broken .dist-info must not break the user's program)."""
    dist: metadata.Distribution | None = None
    version: str | None = None
    location: str | None = None
    problem = "no .dist-info metadata found"
    try:
        dist = metadata.distribution(name)
        text = dist.read_text("METADATA")
        # The Version header; ``dist.version`` parses the long description too: most of detection's time.
        header = re.search(r"(?im)^version:(.*)$", re.split(r"\n\s*\n", text or "", maxsplit=1)[0])
        version = ((header[1].strip() if header else None) or dist.version or "").strip() or None
    except metadata.PackageNotFoundError:
        pass
    except Exception as exc:  # a METADATA that is not UTF-8 raises UnicodeDecodeError
        problem = f"{'METADATA' if dist else 'metadata'} unreadable: {failure(exc)[:200]}"
    else:
        problem = f"METADATA {'missing' if text is None else 'has no Version' if text.strip() else 'empty'}"
    source = NOT_INSTALLED
    if dist is not None:
        try:
            source = read_source(dist.read_text("direct_url.json"))
        except Exception as exc:
            source = Source(kind="unknown", error=f"direct_url.json unreadable: {failure(exc)[:200]}")
        with contextlib.suppress(Exception):
            location = str(dist.locate_file(""))
    if version is not None:
        return Upstream(name, version, source, location)
    where = _importable(name)
    if where is None:  # no version and nothing to import: not installed (a leftover .dist-info at most)
        return Upstream(name, None, NOT_INSTALLED, location)
    if dist is None:
        source = Source(kind="unknown", error=problem)
    return Upstream(name, None, source, location or where, version_unknown=problem)


def _importable(name: str) -> str | None:
    """Where the distribution's package would be imported from (a bare namespace directory does not count)."""
    top, _, sub = PROBES.get(name, name.replace("-", "_")).partition(".")
    try:
        spec = PathFinder.find_spec(top)
        if sub and spec is not None:
            spec = PathFinder.find_spec(f"{top}.{sub}", list(spec.submodule_search_locations or []))
    except Exception:
        return None
    return spec.origin if spec is not None and spec.origin not in (None, "namespace") else None


def detect() -> dict[str, Upstream]:
    return {name: detect_one(name) for name in PROBES}
