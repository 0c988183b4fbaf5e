"""Settle outcomes: do in this process what an import does (no reproduction), and cache them per environment
(``settled.json``) under a key of all that decides them: the import costs seconds (mlx-lm pulls in transformers)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from . import config, store, verdicts
from .engine import Engine
from .locate import module_file, stamp


class Settled(NamedTuple):
    """How the outcomes shown were reached: ``now`` (imported in this process) or ``cache`` (and when)."""

    how: str
    at: float
    #: patch id -> {"state", "reason", "error", "notes"}: what an import in this environment gives.
    outcomes: dict[str, dict[str, Any]]


def environment_key(engine: Engine) -> str:
    """A hash of everything that decides what an import does here: kvpatch's files, the interpreter, ``KVPATCH*``
    variables, the upstreams, the target modules' files, the stored verdicts and cached fingerprints."""
    root = os.path.dirname(os.path.abspath(__file__))
    own = sorted(p for p in Path(root).rglob("*") if "__pycache__" not in p.parts and p.is_file())
    own_files = [(str(p.relative_to(root)), stamp(str(p))) for p in own]
    patches = engine.materialise()
    modules = sorted({m for p in patches for m in p.modules})
    parts: list[Any] = [root, own_files, os.path.realpath(sys.prefix), sys.version, config.values()]
    parts += [sorted(engine.upstream.items()), sorted(p.id for p in patches)]  # an Upstream counts by its repr
    parts.append([(m, module_file(m), stamp(module_file(m))) for m in modules])
    parts += [verdicts.tables()["verdicts"], verdicts.tables()["fingerprints"]]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def settle(engine: Engine, *, fresh: bool = False) -> Settled:
    """Import what the engine would patch (no reproductions) and return every patch's outcome: the cached one for
    this environment unless ``fresh`` or the environment changed (a missing or refused file: settle again)."""
    place = store.env_dir()
    if not fresh and not engine.changes() and place is not None:
        data = store.read_json(place, "settled.json", "settled status")
        with contextlib.suppress(Exception):  # absent or corrupt: settle again
            if data["key"] == environment_key(engine) and isinstance(data["outcomes"], dict):
                return Settled("cache", float(data["at"]), data["outcomes"])
    if engine.active:
        # a module that failed to import: its hooks never ran
        engine.activation.import_pending(engine.materialise(), engine.activation.import_failed)
        engine.refresh()
    outcomes = {
        pid: {"state": st.state.value, "reason": st.reason, "error": st.error, "notes": list(st.notes)}
        for pid, st in engine.status.items()
    }
    settled = Settled("now", time.time(), outcomes)
    if place is not None:
        with contextlib.suppress(OSError):  # a read-only home means settling every time, nothing worse
            data = {"key": environment_key(engine), "at": settled.at, "outcomes": outcomes}
            store.write_json(place, "settled.json", data, "settled status")
    return settled
