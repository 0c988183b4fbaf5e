"""Who measures verdicts: this process inside :func:`measuring_as`, or one detached background verifier that
:func:`request_verification` starts once per process (at most one per environment: it holds ``verify.lock``; a key
it tried is not tried again for an hour). Elsewhere (the user's process) the engine only reads verdicts."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator

from . import config, verdicts
from . import store as _store
from ._warn import failure

_mode: tuple[str | None, bool] = (None, False)  # measuring as, remeasuring
_requested: str | None = None
_patches: set[str] = set()


@contextlib.contextmanager
def measuring_as(by: str, *, remeasure: bool = False) -> Iterator[None]:
    """Within the block the engine measures and stores verdicts as ``by``; ``remeasure``: also where one is stored."""
    global _mode
    saved, _mode = _mode, (by, remeasure)
    try:
        yield
    finally:
        _mode = saved


@contextlib.contextmanager
def measuring_patch(patch_id: str) -> Iterator[bool]:
    """Mark ``patch_id`` measured for the block; yields False if it already is (the measurement's own imports)."""
    first = patch_id not in _patches
    _patches.add(patch_id)
    try:
        yield first
    finally:
        if first:
            _patches.discard(patch_id)


def measuring() -> str | None:
    """What this process measures as (``None``: it only reads verdicts)."""
    return _mode[0]


def remeasure() -> bool:
    return _mode[1]


def request_verification(keys: list[str]) -> str:
    """Start one background verification unless one runs or was tried; the note ``status`` shows. Never raises."""
    global _requested
    if _requested is None:
        try:
            _requested = _start(keys)
        except Exception as exc:  # never break the import
            _requested = f"no verdict yet (background verification could not start: {failure(exc)});"
        _requested += " run `python -m kvpatch verify` to settle it now"
    return _requested


#: The detaching step (``python -I -S -c``, in ``/``): start the verifier (its standard output and error to the log,
#: ``verify.lock`` inherited), print its pid and exit, so that the verifier is nobody's child in the user's process.
_DETACH = (
    "import os, sys\n"
    "log = int(sys.argv[1])\n"
    "act = [(os.POSIX_SPAWN_DUP2, log, 1), (os.POSIX_SPAWN_DUP2, log, 2), (os.POSIX_SPAWN_CLOSE, log)]\n"
    "print(os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ, file_actions=act))\n"
)


def _start(keys: list[str]) -> str:
    """Start the verifier detached (no shell, new session, reaped at once: no child left to this process) holding
    ``verify.lock``, unless it must not run or its verdicts could not be stored (the attempt is stored first: a key
    tried is not tried again for an hour). Its ``sys.path`` has no directory kvpatch did not choose: ``-P``, our
    ``-I -E -s -S``, cwd ``/`` (only root's)."""
    import subprocess

    reasons = {
        "this is a verification process": config.verifying() or measuring() is not None,
        f"{config.VERIFY}=never": not config.background_verification(),
        "KVPATCH=off": config.is_off(),
        "no background verification on this platform": os.name != "posix" or not hasattr(os, "posix_spawn"),
    }
    if (why_not := next((why for why, applies in reasons.items() if applies), None)) is not None:
        return f"no verdict for this environment yet ({why_not}):"
    for tried in [verdicts.tables()["attempts"].get(k) for k in keys]:
        if isinstance(tried, dict) and time.time() - float(tried.get("at", 0)) < 3600:
            when = time.strftime("%H:%M", time.localtime(float(tried["at"])))
            return f"no verdict yet: a background verification started at {when} has not settled it;"
    place = verdicts.write_place()
    if place is None:
        where = ", ".join(str(p.path) for p in _store.verdict_places())
        return f"no verdict yet, and no writable place for one ({where});"
    # the verifier holds the lock through its own copy of the descriptor
    with _store.locked(place, "verify.lock", wait=False, what="verdicts") as fd:
        if fd is None:
            return "no verdict yet: a verification is running for this environment;"
        now = time.time()
        not_stored = verdicts.update(lambda data: data["attempts"].update({k: {"at": now} for k in keys}), wait=False)
        if not_stored is not None:  # a verifier could not store its verdicts either (a full disk): none is started
            return f"no verdict yet, and none could be stored now ({not_stored});"
        flags = ["-P"] if sys.version_info >= (3, 11) and not sys.flags.isolated else []
        kept = {"-I": sys.flags.isolated, "-E": sys.flags.ignore_environment, "-s": sys.flags.no_user_site}
        flags += [f for f, on in {**kept, "-S": sys.flags.no_site}.items() if on]
        command = [sys.executable, *flags, "-m", "kvpatch", "verify", "--background", ",".join(keys)]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"} | {config.VERIFYING: "1"}
        log = place.path / "verify.log"
        with os.fdopen(_store.open_log(place, log.name, "verdicts"), "ab") as out:
            detach = [sys.executable, "-I", "-S", "-c", _DETACH, str(out.fileno()), *command]
            with subprocess.Popen(
                detach,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=out,
                pass_fds=(fd, out.fileno()),
                cwd="/",
                env=env,
                start_new_session=True,
            ) as proc:
                try:
                    said = proc.communicate(timeout=60)[0].strip()
                except BaseException:
                    proc.kill()
                    raise
            if proc.returncode or not said.isdigit():
                raise OSError(f"the verifier did not start (exit {proc.returncode}; {log} says why)")
            pid = int(said)
    where = f"pid {pid}, log {log}"
    return f"no verdict for this environment yet: verifying in the background ({where});"
