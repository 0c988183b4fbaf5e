"""``python -m kvpatch verify``: measure and store, in this process, every verdict the environment's imports read (with
every patch enabled). Exit 74 (EX_IOERR) when one is not stored, so that a build step running it fails."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

from . import config, deactivate, get_engine, verdicts
from .engine import PatchStatus
from .states import MEANINGS, Check, State
from .verifier import Verifier

EXIT_NOT_STORED = 74


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output (schema kvpatch.verify/1)")
    parser.add_argument(
        "--missing", action="store_true", help="measure only patches without a stored verdict (default: all again)"
    )
    parser.add_argument("--background", metavar="KEYS", help=argparse.SUPPRESS)  # the background verifier's start


def run(args: argparse.Namespace) -> int:
    from .cli import emit  # the commands' one way to standard output: closed or full, the command exits 74

    if args.background:  # holding verify.lock through the descriptor its starter passed on (the attempt stored)
        with contextlib.suppress(OSError, AttributeError):
            os.nice(10)
    Verifier.begin()  # before anything imports upstream
    deactivate()
    engine = get_engine()
    engine.reconsider(config.Config(enable_all=True))
    engine.activate()
    by, remeasure = ("background", False) if args.background else ("verify", not args.missing)
    verifier = Verifier(engine, by, remeasure=remeasure)
    rows = [
        {
            "id": st.patch.id,
            "action": st.decision.action.value,
            "state": "could not run"
            if st.patch.id in verifier.errors and st.state is State.PENDING
            else st.state.value,
            "verdict": st.verified,
            "drift": list(st.drift),
            "reason": st.reason,
            "error": verifier.errors.get(st.patch.id) or st.error,
            # what the verdict was judged on, where this process measured one (kvpatch.verdicts.sizes_of)
            "sizes": verdicts.sizes_of(st.measurement.before, st.measurement.after) if st.measurement else None,
        }
        for st in verifier.run()
    ]
    engine.deactivate()
    # settled: clean for --check (pending: optional targets absent); "could not run" is none
    settled = {state.value for state, meaning in MEANINGS.items() if meaning.check is Check.CLEAN}
    unsettled = [r for r in rows if r["state"] not in settled]
    lost = dict(verdicts.unstored)
    code = EXIT_NOT_STORED if lost else 1 if unsettled or engine.broken else 0
    where = verdicts.write_place()
    if args.json:
        cache = str(where.path / verdicts.FILE) if where else None
        data = {"schema": "kvpatch.verify/1", "cache": cache, "patches": rows, "broken": dict(engine.broken)}
        emit(json.dumps({**data, "not_stored": lost, "exit": code}, indent=2))
    else:
        for r in rows:
            if r["verdict"] or r["state"] not in settled - {State.PENDING.value}:
                emit(f"{r['id']:<26} {r['state']:<20} {r['verdict'] or r['error'] or r['reason']}")
        for module, error in engine.broken.items():
            emit(f"BROKEN {module}: {error}")
        verified = sum(1 for r in rows if r["verdict"])
        decided = sum(1 for r in rows if r["action"] in ("apply", "not needed"))
        stored = f"stored in {where.path / verdicts.FILE}" if where else "not stored: no writable cache"
        emit(
            f"kvpatch verify: verified {verified} patch(es) whose outcome depends on a reproduction here ({stored}); "
            f"{decided} decided by the installed release need none (`kvpatch status --verify` measures those too); "
            f"{len(unsettled)} need attention (exit {code})"
        )
    if lost:
        print(
            f"kvpatch verify: {len(lost)} verdict(s) were measured but NOT stored ({next(iter(lost.values()))}); "
            f"later processes will show them as pending verification (exit {EXIT_NOT_STORED})",
            file=sys.stderr,
        )
    return code


def _row(st: PatchStatus, error: str | None) -> dict[str, Any]:
    """``st`` as ``verify`` reports it (``error``: why a target module of a patch still pending did not import)."""
    return {
        "id": st.patch.id,
        "action": st.decision.action.value,
        "state": "could not run" if error and st.state is State.PENDING else st.state.value,
        "verdict": st.verified,
        "drift": list(st.drift),
        "reason": st.reason,
        "error": error or st.error,
        # what the verdict was judged on, where this process measured one (kvpatch.verdicts.sizes_of)
        "sizes": verdicts.sizes_of(st.measurement.before, st.measurement.after) if st.measurement else None,
    }
