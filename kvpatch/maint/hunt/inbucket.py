"""The hunt inside one bucket's process (upstream importable, kvpatch off or on as the parent chose): the cache-level
state machines, the lazy-metadata drives and the model-level comparison, within a time budget. Prints one marked
JSON line per finding and one summary line; the parent (:mod:`kvpatch.maint.hunt.cli`) attributes the findings.

    python -m kvpatch.maint.hunt.inbucket '{"budget": 120, "levels": ["cache", "lazy", "model"], "seed": 0}'
"""

from __future__ import annotations

import json
import sys
import time
from importlib import metadata
from typing import Any

from . import repro
from .machine import Caught

MARK = "KVPATCH-HUNT "
#: How the cache level's time is shared: batch classes (the most operations, the most bugs) over ArraysCache over a
#: single-row class.
WEIGHTS = {"batch": 3, "arrays": 2, "single": 1}


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(record) + "\n")
    sys.stdout.flush()


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in ("mlx", "mlx-lm", "mlx-vlm"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def where(found: dict[str, str | None]) -> str:
    return ", ".join(f"{d} {v}" for d, v in found.items() if v)


def related(script: str) -> list[str]:
    """The upstream modules the script's upstream modules take functions and classes from (a re-export: mlx-vlm <=
    0.6.3's cache module is mlx-lm's classes, its attention calls mlx-lm's quantized attention): a patch there may
    bear on the finding too."""
    import importlib
    import re

    out: list[str] = []
    for name in re.findall(r"^from (mlx_(?:lm|vlm)[\w.]*) import", script, flags=re.M):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for value in vars(module).values():
            origin = getattr(value, "__module__", None)
            if (
                isinstance(origin, str)
                and origin != name
                and origin.split(".", 1)[0] in ("mlx_lm", "mlx_vlm")
                and (isinstance(value, type) or callable(value))
                and origin not in out
            ):
                out.append(origin)
    return out


def finding(caught: Caught, level: str, at: str) -> dict[str, Any]:
    v = caught.violation
    text = repro.script(caught, at)
    return {
        "kind": "finding",
        "level": level,
        "target": v.target,
        "invariant": v.invariant,
        "operation": v.operation,
        "situation": list(v.situation),
        "error": v.error,
        "detail": v.detail,
        "signature": list(v.signature),
        "script": text,
        "modules": caught.modules or related(text),
        "length": repro.length(text),
    }


def _distributions(found: dict[str, str | None]) -> tuple[str, ...]:
    """The distributions this bucket hunts: mlx-vlm's own classes where mlx-vlm is installed (its mlx-lm release
    has a bucket of its own), else mlx-lm's."""
    return ("mlx_vlm",) if found.get("mlx-vlm") else ("mlx_lm",)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0]) if argv else {}
    budget = float(spec.get("budget", 120))
    levels = tuple(spec.get("levels", ("cache", "lazy", "model")))
    seed = int(spec.get("seed", 0))
    only = set(spec.get("only", ()))
    started = time.monotonic()
    found = versions()
    at = where(found)
    emit({"kind": "env", "versions": found, "executable": sys.executable})

    from . import lazy, machine, search, targets

    dists = _distributions(found)
    hunted, skipped = targets.discover(dists)
    if only:
        hunted = [t for t in hunted if t.id in only or t.name in only]
    for target in list(hunted):
        why = search.smoke(target)
        if why is not None:
            skipped[target.id] = why
            hunted.remove(target)
    notes: list[str] = []
    counts = {"cache": 0, "lazy": 0, "model": 0}
    shares = _shares(levels, budget)
    if "lazy" in levels:
        for target in lazy.lazy_targets(hunted):
            for caught in lazy.drive(target):
                emit(finding(caught, "cache", at))
                counts["lazy"] += 1
    if "cache" in levels and hunted:
        known: set[tuple[str, ...]] = set()
        for caught in machine.static_checks(hunted):
            known.add(caught.violation.signature)
            emit(finding(caught, "cache", at))
            counts["cache"] += 1
        left = max(shares["cache"] - (time.monotonic() - started), 1.0)
        weights = [WEIGHTS[t.kind] for t in hunted]
        for target, weight in zip(hunted, weights, strict=True):
            outcome = search.hunt_target(target, left * weight / sum(weights), seed=seed, known=known)
            notes.extend(f"{target.id}: {n}" for n in outcome.notes)
            for caught in outcome.caught:
                emit(finding(caught, "cache", at))
                counts["cache"] += 1
    if "model" in levels:
        from . import models

        def done(name: str, caught: Caught | None, why: str | None) -> None:
            if caught is not None:
                emit(finding(caught, "model", at))
                counts["model"] += 1
            emit({"kind": "architecture", "name": name, "covered": why is None, "why": why})

        left = max(budget - (time.monotonic() - started), 1.0)
        report = models.hunt(
            dists,
            left,
            seed=seed,
            skip=tuple(spec.get("skip", ())),
            begin=lambda name: emit({"kind": "begin", "name": name}),
            done=done,
        )
        notes.extend(report.notes)
    emit(
        {
            "kind": "summary",
            "targets": [t.id for t in hunted],
            "not_hunted": skipped,
            "counts": counts,
            "notes": notes,
            "seconds": round(time.monotonic() - started, 1),
        }
    )
    return 0


def _shares(levels: tuple[str, ...], budget: float) -> dict[str, float]:
    """Where the budget goes: the cache level takes it all unless the model level runs too (then 70/30)."""
    if "model" in levels and "cache" in levels:
        return {"cache": budget * 7 / 10, "model": budget * 3 / 10}
    return {"cache": budget, "model": budget}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
