"""Verification. A patch whose outcome its reproduction decides is settled by a verdict, measured only in a
verification process (``kvpatch verify``, ``status --verify``, the regression tests, the upstream check's child) by
one :class:`Verifier`, outside every import hook. Every other process reads verdicts and, lacking one, starts one
detached background verifier (:func:`request_verification`): at most one per environment (it holds
``verify.lock``); a key it tried is not tried again for an hour."""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Iterable
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from . import config, fingerprints, verdicts
from . import store as _store
from ._warn import failure
from .record import Patch

if TYPE_CHECKING:
    from .engine import Engine, PatchStatus


class Verifier:
    """Settles, in this process, the patches whose outcome the reproduction decides (:meth:`run`)."""

    def __init__(self, engine: Engine, by: str, *, remeasure: bool = True) -> None:
        self.engine, self.by = engine, by
        self.remeasure = remeasure  # also where a verdict is stored
        self.errors: dict[str, str] = {}  # patch id -> why one of its target modules could not be imported

    @staticmethod
    def begin() -> None:
        """Make this process a verification process: nothing started from here starts a verification of its own,
        and it computes on the CPU from before it imports upstream, which binds its generation stream to the default
        device at import (``mlx_lm.generate``), where a reproduction's CPU stream does not reach: a logic bug's
        reproduction would still meet the GPU's arithmetic and its missing kernels. A reproduction of a device's bug
        still runs on the GPU (:func:`kvpatch.engine.run_reproduction`)."""
        os.environ[config.VERIFYING] = "1"
        with suppress(ImportError):
            mx: Any = importlib.import_module("mlx.core")
            mx.set_default_device(mx.cpu)

    def run(self, patches: Iterable[Patch] | None = None) -> list[PatchStatus]:
        """Settle ``patches`` (default: every one) with the engine active, in install order: their targets imported
        first (the hooks install what a version fact or a stored verdict decides), then each patch still to settle
        verified; their statuses."""
        engine = self.engine
        records = engine.materialise() if patches is None else list(patches)
        engine.activation.import_pending(records, lambda pid, _, exc: self.errors.setdefault(pid, failure(exc)))
        for st in [engine.status[p.id] for p in records]:
            if st.verdict_key is not None and (self.remeasure or st.verified is None):
                self.verify(st)
        fingerprints.save(wait=True)
        return [engine.status[p.id] for p in records]

    def verify(self, st: PatchStatus) -> None:
        """Measure ``st``'s patch without and with it, store the verdict, and install the patch where it says so."""
        try:
            st.measurement = self.engine.measure(st.record)
        except Exception as exc:
            self.engine.activation.fail(st, exc)
            return
        verdict = verdicts.verdict_of(st.measurement.before, st.measurement.after, by=self.by)
        if st.verdict_key is not None:
            verdicts.store(st.verdict_key, st.record, verdict, self.engine.upstream)
        self.engine.activation.settle(st, verdict)


_requested: str | None = None


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
        "this is a verification process": config.verifying() is not None,
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
    with (
        _store.opened(place, "verdicts", create=True) as directory,
        directory.locked("verify.lock", wait=False) as fd,
    ):
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
        with os.fdopen(directory.open(log.name, os.O_WRONLY | os.O_APPEND), "ab") as out:
            detach = [sys.executable, "-I", "-S", "-c", _DETACH, str(out.fileno()), *command]
            proc = subprocess.run(  # killed, waited for, on a timeout or any exception
                detach,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=out,
                pass_fds=(fd, out.fileno()),
                cwd="/",
                env=env,
                start_new_session=True,
                timeout=60,
            )
            said = proc.stdout.strip()
            if proc.returncode or not said.isdigit():
                raise OSError(f"the verifier did not start (exit {proc.returncode}; {log} says why)")
            return f"no verdict for this environment yet: verifying in the background (pid {int(said)}, log {log});"
