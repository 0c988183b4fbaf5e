"""Verdicts: what a patch's reproduction found in this environment, measured only in a verification process
(:class:`kvpatch.verifier.Verifier`), read by every other from ``verdicts.json`` (with the verifier's attempts and
the fingerprint cache) in each of :func:`kvpatch.store.verdict_places` (one stored at image build time serves every
user)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from . import store as _store
from ._warn import emit, failure, quoted
from .locate import module_file, stamp
from .record import Bug
from .states import Outcome

if TYPE_CHECKING:
    from .detect import Upstream
    from .record import Finding, Patch

SCHEMA = "kvpatch.verdicts/1"
FILE = "verdicts.json"
MAX_ENTRIES = 512
_TABLES = ("verdicts", "attempts", "fingerprints")


#: The outcomes (:class:`kvpatch.states.Outcome`) a verdict file keeps.
STORED = frozenset({Outcome.FIXED, Outcome.ABSENT, Outcome.NOT_FIXED, Outcome.INCONCLUSIVE, Outcome.SKIPPED})


#: The sizes a verdict was judged on (:func:`sizes_of`): per side (``"without"``, ``"with"`` the patch) the computed
#: difference's ``error`` and the ``rounding`` it was held to; a side whose symptom is structural has none.
Sizes = dict[str, dict[str, float]]


class Verdict(NamedTuple):
    """An outcome, when and by what it was measured, the file it was read from (``""``: none, it is in memory) and the
    sizes it was judged on (``None``: a reproduction that compares no computed numbers)."""

    outcome: Outcome
    detail: str = ""
    at: float = 0.0
    by: str = ""
    source: str = ""
    sizes: Sizes | None = None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.at)) if self.at else "?"
        shown = (Outcome.INCONCLUSIVE, Outcome.SKIPPED, Outcome.NOT_FIXED)
        detail = f": {self.detail}" if self.detail and self.outcome in shown else ""
        return f"{self.outcome.value}{detail} (verdict of {when}{', ' + self.by if self.by else ''})"


def judge(before: Finding, after: Finding | None, foreign: Sequence[str] = ()) -> tuple[Outcome, str]:
    """The outcome and detail of runs without and with the patch (``after`` ``None``: not tried). ``foreign``: targets
    holding another library's code during the run without: an absent bug is then its fix, not upstream's."""
    if before.bug is Bug.SKIPPED:
        return Outcome.SKIPPED, before.skipped or ""
    if before.bug is Bug.INCONCLUSIVE:
        return Outcome.INCONCLUSIVE, f"without the patch: {before.inconclusive}"
    if before.bug is Bug.ABSENT:
        return (Outcome.ELSEWHERE, ", ".join(foreign)) if foreign else (Outcome.ABSENT, before.detail)
    if after is None:
        return Outcome.UNPATCHED, before.detail
    if after.bug is Bug.INCONCLUSIVE:
        return Outcome.INCONCLUSIVE, f"bug present without the patch; with it: {after.inconclusive}"
    if after.bug is Bug.PRESENT:
        return Outcome.NOT_FIXED, after.detail
    if after.bug is Bug.SKIPPED:
        return Outcome.INCONCLUSIVE, f"bug present; with the patch the reproduction skipped: {after.skipped}"
    return Outcome.FIXED, before.detail


def sizes_of(before: Finding | None, after: Finding | None) -> Sizes | None:
    """The sizes of runs without and with a patch (:func:`kvpatch.patches._numbers.judge` keeps them on a finding)."""
    sides = {
        side: {"error": f.error, "rounding": f.rounding}
        for side, f in (("without", before), ("with", after))
        if f is not None and f.error is not None and f.rounding
    }
    return sides or None


def margin(sizes: Sizes | None) -> str | None:
    """How far the measured sizes are from the rounding, in words (``None``: no computed difference was measured)."""
    if not sizes:
        return None

    def said(side: dict[str, float]) -> str:
        error, rounding = side["error"], side["rounding"]
        return f"{error:.2g} = {error / rounding:.3g}x the rounding ({rounding:.2g})"

    parts = [f"without the patch {said(sizes['without'])}" if "without" in sizes else "without the patch: no size"]
    if "with" in sizes:
        parts.append(f"with it {said(sizes['with'])}")
    return "; ".join(parts)


def verdict_of(before: Finding, after: Finding | None, *, by: str = "") -> Verdict:
    """The verdict to store: it is about upstream's code (no foreign credit); an untried patch is inconclusive."""
    outcome, detail = judge(before, after)
    if outcome is Outcome.UNPATCHED:
        outcome, detail = Outcome.INCONCLUSIVE, "bug present; the patch could not be tried"
    return Verdict(outcome, detail, time.time(), by, sizes=sizes_of(before, after))


def write_place() -> _store.Place | None:
    """The place verdicts are written to (``None``: no usable one; they are kept in memory)."""
    return next((p for p in _store.verdict_places() if _store.usable(p, "verdicts")), None)


def _parse(data: Any) -> dict[str, Any]:
    """A verdict file's tables; anything absent, corrupt or foreign reads as empty."""
    data = data if isinstance(data, dict) and data.get("schema") == SCHEMA else {}
    return {"schema": SCHEMA, **{t: data[t] if isinstance(data.get(t), dict) else {} for t in _TABLES}}


#: Tables changed in this process that no file holds.
_memory: dict[str, Any] = _parse(None)
#: Verdict keys measured in this process that no file holds -> why (``kvpatch verify`` fails on them).
unstored: dict[str, str] = {}
_loaded: dict[str, Any] | None = None


def update(change: Callable[[dict[str, Any]], None], *, wait: bool = True) -> str | None:
    """Apply ``change`` to the writable file's tables, read afresh under its lock; never raises. Returns why it was
    not written (``None``: written): ``change`` then went to memory, with one warning, unless the lock was taken."""
    global _loaded
    why = "no usable directory (" + ", ".join(quoted(p.path) for p in _store.verdict_places()) + ")"
    try:
        place = write_place()
        if place is not None:
            # read and written through one opened directory: what is read is what the write replaces
            with (
                _store.opened(place, "verdicts", create=True) as directory,
                directory.locked("verdicts.lock", wait=wait) as held,
            ):
                if held is None:
                    return "another process held the lock"  # this change waits for a later process
                data = _parse(directory.read_json(FILE))
                change(data)
                for t in _TABLES:  # the newest MAX_ENTRIES of each table
                    by_age = sorted(data[t].items(), key=lambda e: e[1].get("at", 0) if isinstance(e[1], dict) else 0)
                    data[t] = dict(by_age[-MAX_ENTRIES:])
                directory.write_json(FILE, data)
            _loaded = None
            return None
    except Exception as exc:  # a cache must never break anything
        why = failure(exc)
    change(_memory)
    _loaded = None
    if not all(_store.untrusted(p) for p in _store.verdict_places()):  # an untrusted place has said so, once
        emit(f"kvpatch could not write its verdicts ({why}); they are kept in memory", key="verdicts:memory")
    return why


def tables() -> dict[str, Any]:
    """Every readable file's tables (earlier places win; a verdict names its file as ``source``), then memory."""
    global _loaded
    if _loaded is None:
        layers = []
        for place in reversed(_store.verdict_places()):
            data = _parse(_store.read_json(place, FILE, "verdicts"))
            source = {"source": str(place.path / FILE)}
            data["verdicts"] = {k: {**v, **source} if isinstance(v, dict) else v for k, v in data["verdicts"].items()}
            layers.append(data)
        _loaded = {t: {k: v for layer in [*layers, _memory] for k, v in layer[t].items()} for t in _TABLES}
    return _loaded


def _kvpatch_version() -> str:
    from . import __version__  # here: kvpatch/__init__ imports this module before it defines __version__

    return __version__


def key(patch: Patch, upstream: Mapping[str, Upstream]) -> str:
    """A hash of everything a verdict for ``patch`` depends on (upstream's PEP 610 source too)."""
    patch_file = getattr(sys.modules.get(patch.module), "__file__", None)
    parts = {
        "kvpatch": _kvpatch_version(),
        "patch": [patch.id, patch_file, stamp(patch_file)],
        "python": [sys.version_info[0], sys.version_info[1], sys.platform],
        "upstream": {
            name: [up.version, up.source.kind, up.source.url, up.source.commit] for name, up in sorted(upstream.items())
        },
        "files": [[name, path, stamp(path)] for name in patch.modules for path in [module_file(name)]],
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def lookup(verdict_key: str) -> Verdict | None:
    """The stored verdict for ``verdict_key`` written by this kvpatch version, or ``None``. Never raises."""
    with contextlib.suppress(Exception):  # absent, corrupt or another kvpatch version's
        entry = tables()["verdicts"][verdict_key]
        if entry["outcome"] in STORED and entry["kvpatch"] == _kvpatch_version():
            detail, by, source = (str(entry.get(k, "")) for k in ("detail", "by", "source"))
            sizes = _sizes(entry.get("sizes"))
            return Verdict(Outcome(entry["outcome"]), detail, float(entry.get("at", 0)), by, source, sizes)
    return None


def _sizes(data: Any) -> Sizes | None:
    """Sizes as a verdict file holds them, or None where they are absent or malformed (a file is never trusted)."""
    if not isinstance(data, dict):
        return None
    sides = {
        side: {"error": float(v["error"]), "rounding": float(v["rounding"])}
        for side, v in data.items()
        if side in ("without", "with")
        and isinstance(v, dict)
        and all(isinstance(v.get(k), (int, float)) and not isinstance(v.get(k), bool) for k in ("error", "rounding"))
        and v["rounding"] > 0
    }
    return sides or None


def store(verdict_key: str, patch: Patch, verdict: Verdict, upstream: Mapping[str, Upstream]) -> bool:
    """Keep ``verdict`` for every later process (never raises). False: only in memory (:data:`unstored` says why)."""
    up = upstream.get(patch.distribution)
    entry = {
        "patch": patch.id,
        "outcome": verdict.outcome.value,
        "detail": verdict.detail[:2000],
        "at": verdict.at,
        "by": verdict.by,
        "upstream": f"{patch.distribution} {up.version if up else None} ({up.source.kind if up else '?'})",
        "kvpatch": _kvpatch_version(),
        **({"sizes": verdict.sizes} if verdict.sizes else {}),
    }

    def change(data: dict[str, Any]) -> None:
        data["verdicts"][verdict_key] = entry
        data["attempts"].pop(verdict_key, None)

    why = update(change)
    unstored.pop(verdict_key, None)
    if why is not None:
        unstored[verdict_key] = why
    return why is None
