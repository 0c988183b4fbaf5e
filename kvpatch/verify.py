"""``python -m kvpatch verify``: measure and store, in this process, every verdict the environment's imports read (with
every patch enabled). Exit 74 (EX_IOERR) when one is not stored, so that a build step running it fails."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from . import config, deactivate, fingerprints, get_engine, measurer, verdicts
from ._warn import failure
from .engine import State, compute_on_cpu
from .settle import import_pending

_SETTLED = ("applied", "not needed", "out of range", "not installed", "opt-in", "disabled")
EXIT_NOT_STORED = 74


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output (schema kvpatch.verify/1)")
    parser.add_argument(
        "--missing", action="store_true", help="measure only patches without a stored verdict (default: all again)"
    )
    parser.add_argument("--background", metavar="KEYS", help=argparse.SUPPRESS)  # measurer._start's child


def run(args: argparse.Namespace) -> int:
    from .cli import emit  # the commands' one way to standard output: closed or full, the command exits 74

    if args.background:  # holding verify.lock through the descriptor measurer._start passed on (the attempt stored)
        with contextlib.suppress(OSError, AttributeError):
            os.nice(10)
    os.environ[config.VERIFYING] = "1"  # nothing started from here starts a verification of its own
    compute_on_cpu()
    deactivate()
    engine = get_engine()
    engine.reconsider(config.Config(enable_all=True))
    errors: dict[str, str] = {}
    by = "background" if args.background else "verify"
    with measurer.measuring_as(by, remeasure=not (args.background or args.missing)):
        engine.activate()
        import_pending(engine, lambda pid, module, exc: errors.update({pid: failure(exc)}))
        fingerprints.save(wait=True)
    rows = [
        {
            "id": st.patch.id,
            "action": st.decision.action.value,
            "state": "could not run" if st.patch.id in errors and st.state is State.PENDING else st.state.value,
            "verdict": st.verified,
            "drift": list(st.drift),
            "reason": st.reason,
            "error": errors.get(st.patch.id) or st.error,
            # what the verdict was judged on, where this process measured one (kvpatch.verdicts.sizes_of)
            "sizes": verdicts.sizes_of(st.measurement.before, st.measurement.after) if st.measurement else None,
        }
        for st in (engine.status[patch.id] for patch in engine.materialise())
    ]
    engine.deactivate()
    unsettled = [r for r in rows if r["state"] not in (*_SETTLED, "pending")]  # pending: optional targets absent
    lost = dict(verdicts.unstored)
    code = EXIT_NOT_STORED if lost else 1 if unsettled or engine.broken else 0
    where = verdicts.write_place()
    if args.json:
        cache = str(where.path / verdicts.FILE) if where else None
        data = {"schema": "kvpatch.verify/1", "cache": cache, "patches": rows, "broken": dict(engine.broken)}
        emit(json.dumps({**data, "not_stored": lost, "exit": code}, indent=2))
    else:
        for r in rows:
            if r["verdict"] or r["state"] not in _SETTLED:
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
