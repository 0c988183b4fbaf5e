"""The hunt inside one bucket's process (upstream importable, kvpatch off or on as the parent chose): the cache-level
state machines, the lazy-metadata drives and the model-level comparison, within a time budget. Prints one marked
JSON line per finding and one summary line; the parent (:mod:`kvpatch.maint.hunt.cli`) attributes the findings.

    python -m kvpatch.maint.hunt.inbucket '{"levels": ["discover"]}'
    python -m kvpatch.maint.hunt.inbucket '{"levels": ["cache"], "only": ["mlx_lm.models.cache.KVCache"], "budget": 30}'
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
#: How the cache level's time is shared (by the parent): batch classes (the most operations, the most bugs) over
#: ArraysCache over a single-row class.
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
    """One step of a hunt, as the parent (:func:`kvpatch.maint.hunt.cli.hunt_child`) asks for it: ``discover`` (the
    targets and what is not hunted), ``lazy`` and ``static`` (fixed checks of every target), ``cache`` (the state
    machine of the targets in ``only``, within ``budget``) or ``model`` (the architectures matching ``match``, within
    ``budget``, less ``skip``). A process that dies in a target or an architecture loses only that one: the parent
    goes on."""
    spec = json.loads(argv[0]) if argv else {}
    budget = float(spec.get("budget", 120))
    levels = tuple(spec.get("levels", ("discover",)))
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
        hunted = [t for t in hunted if t.id in only]
    if "discover" in levels or "lazy" in levels or "static" in levels:
        for target in list(hunted):
            why = search.smoke(target)
            if why is not None:
                skipped[target.id] = why
                hunted.remove(target)
    notes: list[str] = []
    if "discover" in levels:
        weights = {t.id: WEIGHTS[t.kind] for t in hunted}
        emit({"kind": "targets", "weights": weights, "not_hunted": skipped})
    if "lazy" in levels:
        for target in lazy.lazy_targets(hunted):
            emit({"kind": "begin", "name": f"lazy {target.id}"})
            for caught in lazy.drive(target):
                emit(finding(caught, "cache", at))
    if "static" in levels:
        for caught in machine.static_checks(hunted):
            emit(finding(caught, "cache", at))
    if "cache" in levels:
        for target in hunted:
            emit({"kind": "begin", "name": target.id})
            outcome = search.hunt_target(target, budget / len(hunted), seed=seed)
            notes.extend(f"{target.id}: {n}" for n in outcome.notes)
            for caught in outcome.caught:
                emit(finding(caught, "cache", at))
    if "model" in levels:
        from . import models

        def done(name: str, caught: Caught | None, why: str | None) -> None:
            if caught is not None:
                emit(finding(caught, "model", at))
            emit({"kind": "architecture", "name": name, "covered": why is None, "why": why})

        report = models.hunt(
            dists,
            budget,
            seed=seed,
            skip=tuple(spec.get("skip", ())),
            match=spec.get("match", ""),
            begin=lambda name: emit({"kind": "begin", "name": name}),
            done=done,
        )
        notes.extend(report.notes)
    emit({"kind": "summary", "notes": notes, "seconds": round(time.monotonic() - started, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
