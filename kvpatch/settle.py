"""Settle outcomes: do in this process what an import does (no reproduction), and remember it per environment.

``pending`` is a prediction; operators need the outcome. :func:`settle` imports the target modules of every patch
the gate would apply, so hooks fire and builders run as in a user's process. That import costs seconds (mlx-lm
pulls in transformers), and its outcome is a function of the environment, so it is cached in ``settled.json`` in
the per-user place of :mod:`kvpatch.store` under a key of everything that decides it (:func:`environment_key`);
a missing, refused or mismatching file means settling again (``status --fresh`` always does).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import config, store, verdicts
from .locate import module_file, stamp

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["Settled", "environment_key", "settle"]

_FILE = "settled.json"


@dataclass(frozen=True)
class Settled:
    """How the outcomes shown were reached: ``now`` (imported in this process) or ``cache`` (and when)."""

    how: str
    at: float
    #: patch id -> {"state", "reason", "error", "notes"}: what an import in this environment gives.
    outcomes: dict[str, dict[str, Any]]


def _own_files() -> list[tuple[str, tuple[int, int] | None]]:
    """Each file of kvpatch's package (code, patch units, data) with its size and modification time."""
    root = os.path.dirname(os.path.abspath(__file__))
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
        for name in sorted(files):
            path = os.path.join(directory, name)
            found.append((os.path.relpath(path, root), stamp(path)))
    return found


def environment_key(engine: Engine) -> str:
    """A hash of everything that decides what an import does with ``engine``'s patches here: kvpatch's version,
    location and every file of its package, the interpreter, every ``KVPATCH*`` variable, each upstream's version
    and install source, each target module's and unit's file, and the stored verdicts and cached fingerprints
    (:func:`kvpatch.verdicts.digest`: a verification since the last settle counts)."""
    from . import __version__

    parts: list[Any] = [
        __version__,
        os.path.dirname(os.path.abspath(__file__)),
        _own_files(),
        os.path.realpath(sys.prefix),
        sys.version,
        config.values(),
    ]
    for name, up in sorted(engine.upstream.items()):
        parts.append((name, up.version, up.source.kind, up.source.url, up.source.commit, up.location))
    patches = engine.materialise()
    modules = sorted({m for p in patches for m in p.modules})
    for module in modules:
        path = module_file(module)
        parts.append((module, path, stamp(path)))
    units = sorted({p.module for p in patches if p.module})
    parts.append([(unit, module_file(unit), stamp(module_file(unit))) for unit in units])
    parts.append(sorted(p.id for p in patches))
    parts.append(verdicts.digest())
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def _read(key: str) -> Settled | None:
    place = store.env_dir()
    data = store.read_json(place, _FILE, "settled status") if place is not None else None
    try:
        if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("outcomes"), dict):
            return None
        return Settled("cache", float(data["at"]), data["outcomes"])
    except Exception:  # corrupt: settle again
        return None


def _write(key: str, settled: Settled) -> None:
    place = store.env_dir()
    if place is None or not store.usable(place, "settled status"):
        return
    with contextlib.suppress(OSError):  # a read-only home means settling every time, nothing worse
        store.write_json(place, _FILE, {"key": key, "at": settled.at, "outcomes": settled.outcomes})


def settle(engine: Engine, *, fresh: bool = False) -> Settled:
    """Import what the engine would patch (no reproductions) and return every patch's outcome.

    Uses the cached outcome for this environment unless ``fresh`` or the environment changed.
    """
    from .engine import State, import_target_modules

    key = environment_key(engine)
    if not fresh and not engine.changes():
        cached = _read(key)
        if cached is not None:
            return cached
    if engine.active:
        for st in list(engine.status.values()):
            if st.state is not State.PENDING:
                continue
            # a module that fails to import takes its patch's targets with it: the hooks never ran
            import_target_modules(st.record, functools.partial(engine.import_failed, st.patch.id))
        engine.refresh()
    outcomes = {
        pid: {"state": st.state.value, "reason": st.reason, "error": st.error, "notes": list(st.notes)}
        for pid, st in engine.status.items()
    }
    settled = Settled("now", time.time(), outcomes)
    _write(environment_key(engine), settled)
    return settled
