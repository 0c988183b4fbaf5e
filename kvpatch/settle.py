"""Settle outcomes: do in this process what an import does, and remember it for this environment.

``pending`` is a prediction; operators need the outcome. :func:`settle` imports, in the calling process
(``kvpatch status``), the target modules of every patch the gate would apply, so the post-import hooks
fire, builders run and targets are looked up, exactly as in a user's process: patches end ``applied``,
``failed`` (with the error), ``target missing``, ``drifted`` ... No reproduction runs here.

Importing mlx-lm costs about a second on a quiet machine (transformers), ten under load. The outcome of
that import is a function of the environment, so it is cached per environment and reused while the
environment is unchanged. The key holds everything that decides the outcome:

* kvpatch's version and the location of its package,
* the interpreter (``sys.prefix``, version) and ``KVPATCH``, ``KVPATCH_DISABLE``, ``KVPATCH_ENABLE``,
* each watched distribution's version and install source (PEP 610),
* size and modification time of every target module's source file, found without importing it,
* the stored verdicts (:func:`kvpatch.verdicts.digest`): a verification since the last settle counts.

The cache lives in ``$KVPATCH_CACHE`` (default ``$XDG_CACHE_HOME/kvpatch`` or ``~/.cache/kvpatch``)
under ``state/<hash of sys.prefix>/settled.json``, written atomically; a missing, unreadable or
mismatching file means "settle again". ``kvpatch status --fresh`` always settles again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.machinery
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import verdicts

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["Settled", "environment_key", "settle", "state_dir"]

_VARIABLES = ("KVPATCH", "KVPATCH_DISABLE", "KVPATCH_ENABLE", "KVPATCH_VENDORED")
_FILE = "settled.json"


@dataclass(frozen=True)
class Settled:
    """How the outcomes shown were reached: ``now`` (imported in this process) or ``cache`` (and when)."""

    how: str
    at: float
    #: patch id -> {"state", "reason", "error", "notes"}: what an import in this environment gives.
    outcomes: dict[str, dict[str, Any]]


def state_dir() -> Path:
    """The per-environment folder for kvpatch's small state files (the settled outcome, verdicts)."""
    explicit = os.environ.get("KVPATCH_CACHE")
    if explicit:
        base = Path(explicit)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg) if xdg else Path.home() / ".cache") / "kvpatch"
    env = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:16]
    return base / "state" / env


def _module_file(module: str) -> str | None:
    """The source file of ``module``, found without importing anything (and without kvpatch's finder)."""
    top, _, rest = module.partition(".")
    try:
        spec = importlib.machinery.PathFinder.find_spec(top)
    except Exception:
        return None
    if spec is None or not spec.submodule_search_locations:
        return spec.origin if spec is not None and not rest else None
    base = Path(next(iter(spec.submodule_search_locations)))
    if not rest:
        return str(base / "__init__.py")
    path = base.joinpath(*rest.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return str(candidate)
    return None


def environment_key(engine: Engine) -> str:
    """A hash of everything that decides what an import does with ``engine``'s patches here."""
    from . import __version__

    parts: list[Any] = [
        __version__,
        os.path.dirname(os.path.abspath(__file__)),
        os.path.realpath(sys.prefix),
        sys.version,
        [(name, os.environ.get(name)) for name in _VARIABLES],
    ]
    for name, up in sorted(engine.upstream.items()):
        parts.append((name, up.version, up.source.kind, up.source.url, up.source.commit, up.location))
    patches = engine.materialise()
    modules = sorted({m for p in patches for m in p.modules})
    for module in modules:
        path = _module_file(module)
        try:
            st = os.stat(path) if path else None
        except OSError:
            st = None
        parts.append((module, path, st.st_size if st else None, st.st_mtime_ns if st else None))
    parts.append(sorted(p.id for p in patches))
    # the verdicts decide too: a `kvpatch verify` (or a background verification) since the last settle changes
    # what an import does, so the settled outcome must not outlive it (fingerprints stored beside them do not count)
    parts.append(verdicts.digest())
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def _read(path: Path, key: str) -> Settled | None:
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key or not isinstance(data.get("outcomes"), dict):
            return None
        return Settled("cache", float(data["at"]), data["outcomes"])
    except Exception:  # missing, unreadable, corrupt: settle again
        return None


def _write(path: Path, key: str, settled: Settled) -> None:
    with contextlib.suppress(Exception):  # a read-only home must not break status
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".settled-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump({"key": key, "at": settled.at, "outcomes": settled.outcomes}, fh)
        os.replace(tmp, path)


def settle(engine: Engine, *, fresh: bool = False) -> Settled:
    """Import what the engine would patch (no reproductions) and return every patch's outcome.

    Uses the cached outcome for this environment unless ``fresh`` or the environment changed.
    """
    from .engine import State

    key = environment_key(engine)
    path = state_dir() / _FILE
    if not fresh and not engine.changes():
        cached = _read(path, key)
        if cached is not None:
            return cached
    if engine.active:
        for st in list(engine.status.values()):
            if st.state is not State.PENDING:
                continue
            for module in st.record.modules:
                try:
                    importlib.import_module(module)
                except Exception as exc:
                    # A module that fails to import takes its patch's targets with it: the hooks never ran.
                    # Only optional targets may live in modules that fail (e.g. Metal-only upstream modules).
                    if not all(t.optional for t in st.record.targets if t.module == module):
                        engine.import_failed(st.patch.id, module, exc)
        engine.refresh()
    outcomes = {
        pid: {"state": st.state.value, "reason": st.reason, "error": st.error, "notes": list(st.notes)}
        for pid, st in engine.status.items()
    }
    settled = Settled("now", time.time(), outcomes)
    _write(path, key, settled)
    return settled
