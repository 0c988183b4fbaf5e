"""Verdicts, not workloads: what a reproduction found in this environment, measured once and then only read.

When the facts do not settle a patch (a release newer than the record's ``checked_through``, an
editable, directory or archive install, an unknown git commit, target code that drifted from every
fingerprint recorded for the affected releases), only the patch's reproduction can say whether the
bug is there. A reproduction is a workload (it builds caches, runs attention, seeds mlx's random
generator), so it never runs inside the user's ``import``. It runs in ``python -m kvpatch verify``
(also ``status --verify``, CI, the pytest plugin's ``--kvpatch-verify``, and the background
verification below), and its outcome is stored here as a *verdict*. At import the engine reads the
verdict; that costs a file read once per process and one ``stat`` per target module.

Verdicts: ``bug present, fixed by patch`` (the engine applies the patch), ``bug absent upstream``
(not needed), ``bug present, NOT fixed by patch`` (not applied; ``drifted``), ``inconclusive``
(the reproduction hit something other than the bug; not applied; ``status --check`` fails),
``skipped`` (the reproduction cannot run on this backend; not applied).

Where: ``verdicts.json`` in the places :func:`kvpatch.store.verdict_places` names (the environment's
``<sys.prefix>/var/cache/kvpatch``, then the per-user ``<cache root>/state/<hash of sys.prefix>``;
``KVPATCH_VERDICTS`` overrides both). A reader looks in each (the first wins), so a verdict written by
``kvpatch verify`` at image build time (as root) is found by a server running as another user; it is
written to the first usable one, atomically under a lock (:mod:`kvpatch.store`). A corrupt, foreign or
unreadable file is ignored, never raised. Where no place can be written (or none passes the trust
check) verdicts live in this process's memory: :func:`store` returns False, ``kvpatch verify`` exits
non-zero, one warning says so, and fixes decided by version apply as always.

What a verdict file may do: turn a patch the reproduction decides on (``bug present, fixed by patch``)
or off (every other outcome), for the exact key it is stored under; it never affects a patch the release
decides on code kvpatch validated, and never runs code. Its trust is its directory's: the store refuses a directory that
another user can write (:func:`kvpatch.store.refusal`), which is the guard against a planted verdict.
Each entry names the kvpatch version that wrote it (and the key includes it): an entry written by
another version is ignored. ``status`` names the file each verdict came from.

Key of a verdict (a hash; any change means "no verdict", so the patch goes back to verification):
kvpatch's version, the patch id and the size and modification time of its module's file, Python's
version and platform, the version and PEP 610 install source (kind, url, commit) of mlx, mlx-lm and
mlx-vlm, and the path, size and modification time (ns) of each of the patch's target module files.
Reading the source of every target at import would cost tens of milliseconds (measured: 19 mlx-lm
targets, 64-78 ms under load); a ``stat`` costs microseconds.

No verdict yet (the first process after an upgrade, an editable install, ...): the patch is *not*
applied in that process (state ``pending verification``), and one verification is started in a
detached child process at low priority (``nice`` 10): ``python -m kvpatch verify --background``.
The import does not wait for it: starting it costs one fork and exec, once per process at most. The
child runs with ``-P`` (Python 3.11+) and ``/`` as its working directory, so no directory kvpatch did
not choose is on its ``sys.path``; its output is appended to ``verify.log`` in the store, opened here
without following a symlink.
At most one runs at a time per environment (a lock file held by the child), and a key that a
background verification already tried is not tried again for an hour (``python -m kvpatch verify``
settles it at once). Every later process reads the verdict.
``KVPATCH_VERIFY=never`` turns the background verification off (status then says to run
``kvpatch verify``).

Drift fingerprints: each replaced target's source fingerprint is compared with the ones recorded on
every release of the patch's affected range (``kvpatch/data/fingerprints.json``, written by
``scripts/record_fingerprints.py``). A fingerprint needs the target's source; it is cached here by
the target file's path, size and modification time, so a verified environment reads no source at
import.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import inspect
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import config
from . import store as _store
from ._warn import emit
from .locate import module_file
from .record import Bug

if TYPE_CHECKING:
    from .detect import Upstream
    from .record import Finding, Patch

__all__ = [
    "Outcome",
    "Verdict",
    "fingerprint_cached",
    "foreign_targets",
    "judge",
    "key",
    "lookup",
    "measuring",
    "measuring_as",
    "request_verification",
    "store",
    "validated",
]

log = logging.getLogger(__name__)

#: A directory that overrides where verdicts are kept (tests, read-only environments).
DIR_VAR = config.VERDICTS
#: ``never`` (or ``off``/``0``): no background verification; anything else: on.
VERIFY_VAR = config.VERIFY
#: Set in the environment of a verification process (the background child and ``kvpatch verify``).
CHILD_VAR = config.VERIFYING
SCHEMA = "kvpatch.verdicts/1"
FILE = "verdicts.json"
LOCK = "verdicts.lock"
#: A background verification is not started again for a key tried this recently (seconds).
RETRY_AFTER = 3600.0
#: Entries kept per table (oldest dropped first).
MAX_ENTRIES = 512


class Outcome(str, enum.Enum):
    """What running a reproduction without and with its patch says (see :func:`judge`).

    The values are the strings stored in the verdict file and shown by ``status``: they never change.
    The first five are verdicts (stored); the last three are said only by ``status --verify`` about this
    process (another library fixed it, the patch is not applied here, or the measurement could not run).
    """

    FIXED = "bug present, fixed by patch"
    ABSENT = "bug absent upstream"
    NOT_FIXED = "bug present, NOT fixed by patch"
    INCONCLUSIVE = "inconclusive"
    SKIPPED = "skipped"
    ELSEWHERE = "bug absent in this process, fixed by something else in this process"
    UNPATCHED = "bug present, patch not applied"
    COULD_NOT_RUN = "could not run"


#: The outcomes a stored verdict may have.
STORED = frozenset({Outcome.FIXED, Outcome.ABSENT, Outcome.NOT_FIXED, Outcome.INCONCLUSIVE, Outcome.SKIPPED})


@dataclass(frozen=True)
class Verdict:
    """One measured outcome for one patch in one environment (see the module docstring)."""

    outcome: Outcome
    detail: str = ""
    #: When it was measured (seconds since the epoch).
    at: float = 0.0
    #: What measured it: ``verify``, ``background``, ``status --verify``.
    by: str = ""
    #: The file it was read from (``""``: measured in this process, or kept in memory).
    source: str = ""

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.at)) if self.at else "?"
        shown = (Outcome.INCONCLUSIVE, Outcome.SKIPPED, Outcome.NOT_FIXED)
        detail = f": {self.detail}" if self.detail and self.outcome in shown else ""
        return f"{self.outcome.value}{detail} (verdict of {when}{', ' + self.by if self.by else ''})"


def judge(before: Finding, after: Finding | None, foreign: Sequence[str] = ()) -> tuple[Outcome, str]:
    """The outcome (and its detail) of a reproduction run without the patch (``before``) and with it (``after``,
    ``None`` when the patch was not tried). ``foreign``: targets holding another library's code during the run
    without the patch (:func:`foreign_targets`): an absent bug is then that library's fix, not upstream's."""
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


def verdict_of(before: Finding, after: Finding | None, *, by: str = "") -> Verdict:
    """The verdict to store for a measurement (a verdict is about upstream's code: no foreign credit; a patch
    that could not be tried leaves the measurement inconclusive)."""
    outcome, detail = judge(before, after)
    if outcome is Outcome.UNPATCHED:
        outcome, detail = Outcome.INCONCLUSIVE, "bug present; the patch could not be tried"
    return Verdict(outcome, detail, time.time(), by)


# ------------------------------------------------------------------------------------------------
# Where


def _hashed(text: str, n: int = 16) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:n]


def places() -> tuple[_store.Place, ...]:
    """Where verdicts are looked up, in order; the first usable one is where they are written."""
    return _store.verdict_places()


def write_dir() -> Path | None:
    """The directory verdicts are written to (``None``: nowhere usable: they are kept in memory)."""
    for place in places():
        if _store.usable(place, "verdicts"):
            return place.path
    return None


# ------------------------------------------------------------------------------------------------
# The file


def _empty() -> dict[str, Any]:
    return {"schema": SCHEMA, "verdicts": {}, "attempts": {}, "fingerprints": {}}


def _parse(data: Any) -> dict[str, Any]:
    """The tables of a verdict file's JSON; anything absent, corrupt or foreign reads as empty."""
    out = _empty()
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return out
    for table in ("verdicts", "attempts", "fingerprints"):
        value = data.get(table)
        if isinstance(value, dict):
            out[table] = value
    return out


def _prune(table: dict[str, Any]) -> None:
    if len(table) <= MAX_ENTRIES:
        return
    by_age = sorted(table, key=lambda k: table[k].get("at", 0) if isinstance(table[k], dict) else 0)
    for k in by_age[: len(table) - MAX_ENTRIES]:
        del table[k]


#: Tables changed in this process that no file holds (no usable place, or the write failed).
_memory: dict[str, Any] = _empty()
#: Verdict keys whose :func:`store` did not reach a file, and why (``kvpatch verify`` fails on them).
_unstored: dict[str, str] = {}


def update(change: Callable[[dict[str, Any]], None], *, wait: bool = True) -> bool:
    """Read the writable file afresh, apply ``change`` to its tables, write it back. Never raises.

    ``wait=False`` (the user's process): give up rather than wait when another process is writing.
    Returns whether it was written; where it could not be (no usable place, a failed write), ``change``
    is applied to this process's memory instead and one warning says so.
    """
    why = "no usable directory (" + ", ".join(str(p.path) for p in places()) + ")"
    try:
        for place in places():
            if not _store.usable(place, "verdicts"):
                continue
            with _store.locked(place, LOCK, wait=wait, what="verdicts") as held:
                if not held:
                    return False  # another process is writing: this one's change waits for a later process
                data = _parse(_store.read_json(place, FILE, "verdicts"))
                change(data)
                for table in ("verdicts", "attempts", "fingerprints"):
                    _prune(data[table])
                _store.write_json(place, FILE, data, "verdicts")
            _forget()
            return True
    except Exception as exc:  # a cache must never break anything
        why = f"{type(exc).__name__}: {exc}"
    try:
        change(_memory)
    except Exception:  # pragma: no cover - a change is a few dict assignments
        pass
    _forget()
    if not all(_store.untrusted(p) for p in places()):  # an untrusted place has said so already, once
        emit(f"kvpatch could not write its verdicts ({why}); they are kept in memory", key="verdicts:memory")
    global _last_error
    _last_error = why
    return False


_last_error = ""
_loaded: dict[str, Any] | None = None
#: Verdict key -> the file its stored verdict was read from.
_origins: dict[str, str] = {}


def _tables() -> dict[str, Any]:
    """Every readable file's tables merged (earlier places win), then this process's memory; read once."""
    global _loaded
    if _loaded is None:
        merged = _empty()
        origins: dict[str, str] = {}
        for place in reversed(places()):
            data = _parse(_store.read_json(place, FILE, "verdicts"))
            for table in ("verdicts", "attempts", "fingerprints"):
                merged[table].update(data[table])
            origins.update(dict.fromkeys(data["verdicts"], str(place / FILE)))
        for table in ("verdicts", "attempts", "fingerprints"):
            merged[table].update(_memory[table])
        for k in _memory["verdicts"]:
            origins.pop(k, None)
        _origins.clear()
        _origins.update(origins)
        _loaded = merged
    return _loaded


def unstored() -> dict[str, str]:
    """Verdict keys measured in this process that no file holds, with the reason (empty: all stored)."""
    return dict(_unstored)


def digest() -> str:
    """A short hash of the stored verdicts and cached fingerprints (a changed fingerprint can send a patch to
    its verdict), and of where they were read: what a settled ``status`` outcome depends on. Never raises."""
    try:
        tables = _tables()
        parts = [tables["verdicts"], tables["fingerprints"], sorted(_origins.items())]
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
    except Exception:
        return ""


def _forget() -> None:
    global _loaded
    _loaded = None


# ------------------------------------------------------------------------------------------------
# Keys


_stats: dict[str, tuple[int, int] | None] = {}


def _stat(path: str) -> tuple[int, int] | None:
    """(size, mtime_ns) of ``path``, once per process."""
    if path not in _stats:
        try:
            st = os.stat(path)
            _stats[path] = (st.st_size, st.st_mtime_ns)
        except OSError:
            _stats[path] = None
    return _stats[path]


def _kvpatch_version() -> str:
    """The version of this kvpatch (the package this module belongs to), which every verdict is bound to."""
    try:
        from . import __version__
    except ImportError:  # pragma: no cover - kvpatch/__init__ still importing: no verdict can match
        return "?"
    return str(__version__)


def key_parts(patch: Patch, upstream: Mapping[str, Upstream]) -> dict[str, Any]:
    """What a verdict for ``patch`` depends on (see the module docstring); hashed by :func:`key`."""
    patch_module = sys.modules.get(patch.module) if patch.module else None
    patch_file = getattr(patch_module, "__file__", None)
    files = []
    for name in patch.modules:
        path = module_file(name)
        files.append([name, path, _stat(path) if path else None])
    return {
        "kvpatch": _kvpatch_version(),
        "patch": [patch.id, patch_file, _stat(patch_file) if patch_file else None],
        "python": [sys.version_info[0], sys.version_info[1], sys.platform],
        "upstream": {
            name: [up.version, up.source.kind, up.source.url, up.source.commit] for name, up in sorted(upstream.items())
        },
        "files": files,
    }


def key(patch: Patch, upstream: Mapping[str, Upstream]) -> str:
    return _hashed(json.dumps(key_parts(patch, upstream), sort_keys=True, default=str), 24)


# ------------------------------------------------------------------------------------------------
# Verdicts


def lookup(verdict_key: str) -> Verdict | None:
    """The stored verdict for ``verdict_key`` written by this kvpatch version, or ``None``. Never raises."""
    try:
        entry = _tables()["verdicts"].get(verdict_key)
        if not isinstance(entry, dict) or entry.get("outcome") not in STORED:
            return None
        if entry.get("kvpatch") != _kvpatch_version():
            return None
        return Verdict(
            Outcome(entry["outcome"]),
            str(entry.get("detail", "")),
            float(entry.get("at", 0)),
            str(entry.get("by", "")),
            _origins.get(verdict_key, ""),
        )
    except Exception:
        return None


def store(verdict_key: str, patch: Patch, verdict: Verdict, upstream: Mapping[str, Upstream]) -> bool:
    """Keep ``verdict`` for every later process (waits for the file lock; never raises). False: it was
    kept in this process's memory only (:func:`unstored` says why)."""
    up = upstream.get(patch.distribution)
    entry = {
        "patch": patch.id,
        "outcome": verdict.outcome.value,
        "detail": verdict.detail[:2000],
        "at": verdict.at,
        "by": verdict.by,
        "upstream": f"{patch.distribution} {up.version if up else None} ({up.source.kind if up else '?'})",
        "kvpatch": _kvpatch_version(),
    }

    def change(data: dict[str, Any]) -> None:
        data["verdicts"][verdict_key] = entry
        data["attempts"].pop(verdict_key, None)

    if update(change):
        _unstored.pop(verdict_key, None)
        return True
    _unstored[verdict_key] = _last_error or "another process held the lock"
    return False


# ------------------------------------------------------------------------------------------------
# Who measures: this process, or a background child


_measuring: str | None = None
_remeasure = False
_requested: str | None = None
#: Ids of the patches whose verdict is being measured right now (a hook fired by importing their targets
#: during the measurement must not start a second one).
MEASURING: set[str] = set()


@contextlib.contextmanager
def measuring_as(by: str, *, remeasure: bool = False) -> Iterator[None]:
    """Within the block this process is a verification process: the engine measures verdicts and stores them.

    ``by`` names the measurer (``verify``, ``background``, ``status --verify``). ``remeasure``: measure even
    where a verdict is stored (``kvpatch verify`` does; the background child measures only what is missing).
    Outside such a block (the user's process) the engine only reads verdicts.
    """
    global _measuring, _remeasure
    saved = (_measuring, _remeasure)
    _measuring, _remeasure = by, remeasure
    try:
        yield
    finally:
        _measuring, _remeasure = saved


def measuring() -> str | None:
    """What this process measures as (``None``: it only reads verdicts, the user's process)."""
    return _measuring


def remeasure() -> bool:
    return _remeasure


def _background_allowed() -> str | None:
    """Why no background verification may start here (``None``: it may)."""
    if config.verifying() or _measuring is not None:
        return "this is a verification process"
    if not config.background_verification():
        return f"{VERIFY_VAR}=never"
    if config.is_off():
        return "KVPATCH=off"
    if os.name != "posix":  # pragma: no cover - not POSIX
        return "no background verification on this platform"
    return None


def request_verification(keys: list[str]) -> str:
    """Start one background verification for this environment unless one runs or was tried; say what happened.

    Never blocks the caller beyond starting the detached verifier; never raises. The text is what
    ``status`` shows after "pending verification".
    """
    global _requested
    settle = "run `python -m kvpatch verify` to settle it now"
    if _requested is not None:
        return _requested
    try:
        why_not = _background_allowed()
        if why_not is not None:
            _requested = f"no verdict for this environment yet ({why_not}): {settle}"
            return _requested
        attempts = _tables()["attempts"]
        now = time.time()
        for k in keys:
            tried = attempts.get(k)
            if isinstance(tried, dict) and now - float(tried.get("at", 0)) < RETRY_AFTER:
                when = time.strftime("%H:%M", time.localtime(float(tried["at"])))
                _requested = f"no verdict yet: a background verification started at {when} has not settled it; {settle}"
                return _requested
        place = next((p for p in places() if _store.usable(p, "verdicts")), None)
        if place is None:
            where = ", ".join(str(p.path) for p in places())
            _requested = f"no verdict yet, and no writable place for one ({where}); {settle}"
            return _requested
        _requested = _spawn(place, keys, settle)
    except Exception as exc:  # never break the import
        _requested = f"no verdict yet (background verification could not start: {type(exc).__name__}: {exc}); {settle}"
    return _requested


def _spawn(place: _store.Place, keys: list[str], settle: str) -> str:
    """Start ``python -m kvpatch verify --background`` detached, holding the environment's verify lock.

    The child gets ``-P`` (3.11+: no script or working directory on ``sys.path``), the interpreter flags of
    this process that narrow ``sys.path`` further (``-I``, ``-E``, ``-s``, ``-S``), ``/`` as its working
    directory (no one but root can plant a ``kvpatch`` package there, which also covers Pythons without
    ``-P``), and ``verify.log`` (opened here, ``O_NOFOLLOW``, 0600) as its output: no shell runs. It is a
    new session, so the terminal's signals do not reach it. It is not waited for: it stays a zombie until
    this process exits or ``subprocess`` reaps it at its next ``Popen`` (one entry in the process table,
    at most one per process, as requests are made once); nothing blocks on it.
    """
    import subprocess

    fd = _store.acquire(place, "verify.lock", wait=False, what="verdicts")
    if fd is None:
        return f"no verdict yet: a verification is running for this environment; {settle}"
    try:
        flags = ["-P"] if sys.version_info >= (3, 11) and not sys.flags.isolated else []
        flags += [f for f, on in (("-I", sys.flags.isolated), ("-E", sys.flags.ignore_environment)) if on]
        flags += [f for f, on in (("-s", sys.flags.no_user_site), ("-S", sys.flags.no_site)) if on]
        command = [sys.executable, *flags, "-m", "kvpatch", "verify", "--background", "--lock-fd", str(fd)]
        command += ["--for", ",".join(keys)]
        env = dict(os.environ)
        env[CHILD_VAR] = "1"
        env.pop("PYTHONSTARTUP", None)
        log_path = place / "verify.log"
        out = _store.open_log(place, "verify.log", "verdicts")
        try:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                pass_fds=(fd,),
                cwd="/",
                env=env,
                start_new_session=True,
            )
        finally:
            os.close(out)
        where = f"pid {proc.pid}, log {log_path}"
        return f"no verdict for this environment yet: verifying in the background ({where}); {settle}"
    finally:
        os.close(fd)  # the verifier holds the lock through its own copy of the descriptor


def record_attempt(keys: list[str]) -> None:
    """The background verifier notes the keys it was started for (so they are not retried at once)."""
    now = time.time()

    def change(data: dict[str, Any]) -> None:
        for k in keys:
            if k:
                data["attempts"][k] = {"at": now, "pid": os.getpid()}

    update(change)


# ------------------------------------------------------------------------------------------------
# Whose code sits on a target


def foreign_targets(patch: Patch) -> list[str]:
    """``"<target>: <qualified name>"`` for each of ``patch``'s replaced targets whose live object is not
    upstream's own function (another library's wrapper or replacement), for targets already imported.

    Upstream's own: a plain function (or classmethod / staticmethod of one) defined in a module of the
    patch's distribution. kvpatch's own replacements count as foreign here: take them out first.
    """
    from . import surgery
    from .record import Kind

    found = []
    package = patch.import_name
    for target in patch.targets:
        if target.kind is not Kind.REPLACE:
            continue
        owner: Any = sys.modules.get(target.module)
        for part in target.owner_path:
            owner = getattr(owner, part, None)
        if owner is None:
            continue
        try:
            live = inspect.getattr_static(owner, target.attribute)
        except AttributeError:
            continue
        who = surgery.foreign(live, package)
        if who is not None:
            found.append(f"{target.path}: {who}")
    return found


# ------------------------------------------------------------------------------------------------
# Drift fingerprints


_shipped: dict[str, dict[str, frozenset[str]]] | None = None
#: The fingerprints recorded for every release of each patch's affected range (shipped with kvpatch).
SHIPPED = Path(__file__).resolve().parent / "data" / "fingerprints.json"


def shipped() -> dict[str, dict[str, frozenset[str]]]:
    """``kvpatch/data/fingerprints.json`` as patch id -> target path -> fingerprints (read once)."""
    global _shipped
    if _shipped is None:
        table: dict[str, dict[str, frozenset[str]]] = {}
        path = SHIPPED
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            for pid, targets in data.get("patches", {}).items():
                table[pid] = {t: frozenset(fps) for t, fps in targets.items()}
        except Exception as exc:  # a broken data file must not break imports (a test guards it)
            log.warning("kvpatch: cannot read %s: %s", path, exc)
        _shipped = table
    return _shipped


def validated(patch: Patch) -> dict[str, frozenset[str]]:
    """Target path -> fingerprints the patch was validated on (``kvpatch/data/fingerprints.json``)."""
    return shipped().get(patch.id, {})


_new_fingerprints: dict[str, dict[str, str]] = {}


def fingerprint_cached(obj: Any, compute: Callable[[Any], str | None]) -> str | None:
    """``compute(obj)`` (a source fingerprint), cached by the defining file's path, size and mtime."""
    func = inspect.unwrap(obj) if callable(obj) else obj
    func = getattr(func, "__func__", func)
    code = getattr(func, "__code__", None)
    filename = getattr(code, "co_filename", None)
    stamp = _stat(filename) if filename else None
    if code is None or stamp is None:
        return compute(obj)
    file_key = f"{filename}|{stamp[0]}|{stamp[1]}"
    sub = f"{code.co_firstlineno}:{getattr(func, '__qualname__', '?')}"
    known = _tables()["fingerprints"].get(file_key)
    if isinstance(known, dict) and isinstance(known.get(sub), str):
        return str(known[sub])
    pending = _new_fingerprints.get(file_key, {})
    if sub in pending:
        return pending[sub]
    value = compute(obj)
    if value is not None:
        _new_fingerprints.setdefault(file_key, {})[sub] = value
    return value


def save_fingerprints(*, wait: bool = False) -> None:
    """Write fingerprints computed in this process to the cache (best effort; never waits by default)."""
    if not _new_fingerprints:
        return
    new = {k: dict(v) for k, v in _new_fingerprints.items()}
    now = time.time()

    def change(data: dict[str, Any]) -> None:
        table = data["fingerprints"]
        for file_key, subs in new.items():
            entry = table.get(file_key)
            if not isinstance(entry, dict):
                entry = {}
            entry.update(subs)
            entry["at"] = now
            table[file_key] = entry

    if update(change, wait=wait):
        _new_fingerprints.clear()
