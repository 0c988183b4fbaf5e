"""``python -m kvpatch verify``: settle, in this process, every verdict the environment's imports will read.

The process's engine decides every patch again with all of them considered (a verdict does not depend on
``KVPATCH_DISABLE`` / ``KVPATCH_ENABLE``), imports every target module, and measures each patch the facts leave to its
reproduction (:mod:`kvpatch.gate`), storing the verdict (:mod:`kvpatch.verdicts`) and the targets' fingerprints.
``--background`` is what a user's process starts when it finds no verdict (detached, ``nice`` 10, one per
environment, only what is missing).

Exit status: 0 when every patch is settled; 1 when a verdict is inconclusive, a patch drifted or failed, or a
verification could not run; 74 (EX_IOERR) when a verdict was measured but could not be stored, so that a build step
running ``kvpatch verify`` fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from . import config, fingerprints, measurer, verdicts

__all__ = ["add_arguments", "run"]

_SETTLED = ("applied", "not needed", "out of range", "not installed", "opt-in", "disabled")
#: A verdict was measured and not stored (sysexits.h EX_IOERR).
EXIT_NOT_STORED = 74


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output (schema kvpatch.verify/1)")
    parser.add_argument(
        "--missing", action="store_true", help="measure only patches without a stored verdict (default: all again)"
    )
    parser.add_argument("--background", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lock-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--for", dest="for_keys", default="", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    background = bool(args.background)
    if background and not measurer.background_start(args.lock_fd, [k for k in args.for_keys.split(",") if k]):
        print("kvpatch verify: another verification holds this environment's lock; nothing to do")
        return 0
    os.environ[config.VERIFYING] = "1"  # nothing started from here starts a verification of its own
    import kvpatch

    from .config import Config
    from .engine import State, import_target_modules

    kvpatch.deactivate()
    engine = kvpatch.get_engine()
    engine.reconsider(Config(enable_all=True))
    by = "background" if background else "verify"
    errors: dict[str, str] = {}
    with measurer.measuring_as(by, remeasure=not (background or args.missing)):
        engine.activate()
        for patch in engine.materialise():
            if engine.status[patch.id].state is not State.PENDING:
                continue
            try:
                import_target_modules(patch)
            except Exception as exc:
                errors[patch.id] = f"{type(exc).__name__}: {exc}"
        fingerprints.save(wait=True)
    rows: list[dict[str, Any]] = []
    for patch in engine.materialise():
        st = engine.status[patch.id]
        state = st.state.value
        error = errors.get(patch.id) or st.error
        if patch.id in errors and st.state is State.PENDING:
            state = "could not run"
        rows.append(
            {
                "id": patch.id,
                "action": st.decision.action.value,
                "state": state,
                "verdict": st.verified,
                "drift": list(st.drift),
                "reason": st.reason,
                "error": error,
            }
        )
    engine.deactivate()
    unsettled = [r for r in rows if r["state"] not in _SETTLED and r["state"] != "pending"]
    # "pending": an APPLY patch whose modules imported nothing to patch (optional targets): not a verdict matter
    code = 1 if unsettled or engine.broken else 0
    lost = verdicts.unstored()
    if lost:
        code = EXIT_NOT_STORED
    where = verdicts.write_place()
    if args.json:
        data = {
            "schema": "kvpatch.verify/1",
            "cache": str(where / verdicts.FILE) if where else None,
            "patches": rows,
            "broken": dict(engine.broken),
            "not_stored": lost,
            "exit": code,
        }
        print(json.dumps(data, indent=2))
    else:
        for r in rows:
            if r["verdict"] or r["state"] not in _SETTLED:
                print(f"{r['id']:<26} {r['state']:<20} {r['verdict'] or r['error'] or r['reason']}")
        for module, error in engine.broken.items():
            print(f"BROKEN {module}: {error}")
        verified = sum(1 for r in rows if r["verdict"])
        decided = sum(1 for r in rows if r["action"] in ("apply", "not needed"))
        stored = f"stored in {where / verdicts.FILE}" if where else "not stored: no writable cache"
        print(
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
