"""``python -m kvpatch.maint.hunt``: hunt one or more matrix buckets with kvpatch off and on, and attribute every
finding (:mod:`.attribute`).

    python -m kvpatch.maint.hunt --bucket lm-0.31.3                  # text report
    python -m kvpatch.maint.hunt --bucket vlm-0.7.10 --json --budget 60
    python -m kvpatch.maint.hunt --newest --out hunt-results/        # the newest mlx-lm and mlx-vlm buckets

The two hunts (kvpatch off, kvpatch on) run side by side in child processes of the bucket, each with the budget;
attribution runs after them. Exit status: 0 when nothing is ``new`` and nothing found with kvpatch on is attributed
to a patch (a patch that does not fix what it claims), 1 otherwise, 2 when a bucket could not be hunted.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import attribute
from .inbucket import MARK

SCHEMA = "kvpatch.hunt/1"
#: Seconds each of the two hunts of a bucket runs (side by side): with attribution, a bucket takes under five minutes
#: on two cores.
DEFAULT_BUDGET = 120.0
LEVELS = ("cache", "lazy", "model")
#: Child processes at a time while attributing (the project's machines have two cores).
JOBS = 2
#: Seconds an in-bucket process takes to start (import mlx and upstream) on two cores: not part of a target's share.
STARTUP = 3.0


def hunt_child(env: dict[str, str], spec: dict[str, Any], *, kvpatch: str, timeout: float) -> dict[str, Any]:
    """One hunt (kvpatch off or on) of an environment, as a sequence of in-bucket processes: the targets, the fixed
    checks, one process per cache target (its share of the budget by kind), then the model level. A process that
    dies without a Python exception (a crash inside mlx) loses only the target or architecture it was in, which is
    noted; the model level goes on without the architecture."""
    started = time.monotonic()
    budget = float(spec["budget"])
    levels = set(spec["levels"])
    out: dict[str, Any] = {"findings": [], "kvpatch": kvpatch, "died": {}, "architectures": {}}

    def step(extra: dict[str, Any]) -> dict[str, Any]:
        run = _hunt_once(env, {"seed": spec.get("seed", 0), **extra}, kvpatch=kvpatch, timeout=timeout)
        out["findings"] += run["findings"]
        out["architectures"].update(run.get("architectures", {}))
        if run.get("failure") and run.get("_open"):
            out["died"][run["_open"]] = run["failure"]
        elif run.get("failure"):
            out.setdefault("failures", []).append(run["failure"])
        return run

    found = step({"levels": ["discover"]})
    weights: dict[str, int] = found.get("targets", {}).get("weights", {})
    only = spec.get("only", "")
    if only:  # the random search's budget on the classes named (the fixed checks still see every class)
        weights = {t: w for t, w in weights.items() if re.search(only, t)}
    out["not_hunted"] = found.get("targets", {}).get("not_hunted", {})
    out["targets"] = list(weights)
    fixed = [x for x in ("lazy", "static") if x in levels or ("cache" in levels and x == "static")]
    if fixed:
        step({"levels": fixed})
    model_share = budget * 3 / 10 if "model" in levels else 0.0
    if "cache" in levels and weights:
        # each target's share of what is left, less a process's start (about STARTUP seconds on two cores)
        end = started + budget - model_share
        remaining = sum(weights.values())
        for target, weight in weights.items():
            share = (end - time.monotonic()) * weight / remaining - STARTUP
            remaining -= weight
            step({"levels": ["cache"], "only": [target], "budget": max(share, 1.0)})
    if "model" in levels:
        skip: list[str] = []
        floor = model_share / 2  # the model level keeps half its share even when the cache level ran late
        while True:
            left = max(budget - (time.monotonic() - started), floor)
            floor = 0.0
            if left <= 0:
                break
            run = step({"levels": ["model"], "budget": left, "skip": skip + list(out["architectures"]), "match": only})
            if not (run.get("failure") and run.get("_open")):
                break
            skip.append(run["_open"])
            died = {"covered": False, "why": f"the process died in it ({run['failure']})"}
            out["architectures"][run["_open"]] = died
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


def _hunt_once(env: dict[str, str], spec: dict[str, Any], *, kvpatch: str, timeout: float) -> dict[str, Any]:
    child = {k: v for k, v in env.items() if not k.startswith("KVPATCH") or k in ("KVPATCH_CACHE", "KVPATCH_BUCKET")}
    child["KVPATCH_VERIFY"] = "never"
    child["PYTHONDONTWRITEBYTECODE"] = "1"
    if kvpatch == "off":
        child["KVPATCH"] = "off"
    cmd = [sys.executable, "-P", "-m", "kvpatch.maint.hunt.inbucket", json.dumps(spec)]
    out: dict[str, Any] = {"findings": [], "kvpatch": kvpatch, "_open": None}
    with tempfile.TemporaryDirectory(prefix="kvpatch-hunt-") as cwd:
        try:
            proc = subprocess.run(cmd, cwd=cwd, env=child, capture_output=True, text=True, timeout=timeout)
            stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            stderr, code = "timed out", None
    for line in stdout.splitlines():
        if line.startswith(MARK):
            record = json.loads(line[len(MARK) :])
            kind = record.pop("kind")
            if kind == "finding":
                out["findings"].append(record)
            elif kind == "begin":
                out["_open"] = record["name"]
            elif kind == "architecture":
                out.setdefault("architectures", {})[record.pop("name")] = record
                out["_open"] = None
            elif kind == "summary":
                out["_open"] = None  # the process got to its end
            else:
                out[kind] = record
    if code != 0:
        out["failure"] = f"exit {code}: " + " / ".join(stderr.strip().splitlines()[-3:])
    return out


def bucket_place(name: str) -> tuple[dict[str, str], dict[str, str | None]]:
    """A matrix bucket's environment and releases."""
    from ..matrix import BY_NAME

    bucket = BY_NAME[name]
    return attribute.environ(bucket), {d: bucket.version(d) for d in ("mlx-lm", "mlx-vlm")}


def newest_places() -> list[tuple[str, dict[str, str], dict[str, str | None]]]:
    """The newest mlx-lm and mlx-vlm on the package index (releases under 48 hours old left out), each layered with
    the mlx it asks for, as ``kvpatch upstream-check`` plans them: (name, environment, releases) for each."""
    import datetime as dt
    import os

    from ..upstream_check import Planner

    planner = Planner(include_fresh=False, now=dt.datetime.now(dt.timezone.utc))
    lm, vlm = planner.target("mlx-lm", None), planner.target("mlx-vlm", None)
    out = []
    for env in planner.plan(lm, None, ()) + planner.plan(None, vlm, ()):
        name = " + ".join(f"{d} {v}" for d, v in env.versions.items() if d != "mlx")
        layered = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in env.layers)}
        out.append((name, layered, {d: env.versions.get(d) for d in ("mlx-lm", "mlx-vlm")}))
    return out


def hunt_bucket(
    name: str,
    *,
    budget: float,
    levels: Sequence[str],
    seed: int,
    modes: Sequence[str],
    attribute_findings: bool = True,
    place: Any = None,
    only: str = "",
) -> dict[str, Any]:
    """Hunt one environment: a matrix bucket by ``name``, or ``place`` = (environment, releases)."""
    from ...registry import load

    env, releases = place if place is not None else bucket_place(name)
    spec = {"budget": budget, "levels": list(levels), "seed": seed, "only": only}
    started = time.monotonic()
    timeout = budget * 3 + 600
    with ThreadPoolExecutor(max_workers=len(modes)) as pool:
        runs = dict(
            zip(modes, pool.map(lambda m: hunt_child(env, spec, kvpatch=m, timeout=timeout), modes), strict=True)
        )
    hunted = time.monotonic() - started
    patches = load().patches
    findings: list[dict[str, Any]] = []
    seen: dict[tuple[str, ...], dict[str, Any]] = {}
    for mode in modes:
        for f in runs[mode]["findings"]:
            key = tuple(f["signature"])
            if key in seen:
                # found with kvpatch on as well: that hunt's reproduction is the one to attribute (what remains)
                f["hunts"] = [*seen[key]["hunts"], mode]
                findings[findings.index(seen[key])] = f
                seen[key] = f
                continue
            f["hunts"] = [mode]
            seen[key] = f
            findings.append(f)
    if attribute_findings:
        groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for f in findings:
            groups.setdefault(kinship(f), []).append(f)
        leads = [min(group, key=lambda f: f["length"]) for group in groups.values()]
        with ThreadPoolExecutor(max_workers=JOBS) as pool:
            done = pool.map(lambda f: attribute.attribute(f, env, patches, releases).as_json(), leads)
            for lead, attribution in zip(leads, done, strict=True):
                for f in groups[kinship(lead)]:
                    f["attribution"] = attribution if f is lead else {**attribution, "as": lead["signature"]}
    return {
        "bucket": name,
        "releases": {d: v for d, v in releases.items() if v},
        "budget": budget,
        "levels": list(levels),
        **({"only": only} if only else {}),
        "hunts": {m: {k: v for k, v in r.items() if k != "findings"} for m, r in runs.items()},
        "findings": findings,
        "seconds": {"hunt": round(hunted, 1), "total": round(time.monotonic() - started, 1)},
    }


def kinship(f: dict[str, Any]) -> tuple[str, ...]:
    """Findings taken to be one bug for attribution (their shortest reproduction is attributed, the others inherit the
    verdict): one signature (class, invariant, operation, crash and its message, situation) but for decode / update,
    found by the same hunts."""
    signature = list(f["signature"])
    if len(signature) > 2 and signature[2] == "decode":
        signature[2] = "update"
    return (*signature, *f["hunts"])


def verdict_of(f: dict[str, Any]) -> str:
    return f.get("attribution", {}).get("verdict", "not attributed")


def problems(result: dict[str, Any]) -> list[str]:
    """What fails the command: a new finding, or one that kvpatch on still shows though a patch claims it."""
    out = []
    for f in result["findings"]:
        verdict = verdict_of(f)
        if verdict == "new":
            out.append(f"{result['bucket']}: new: {f['target']}: {f['invariant']} after {f['operation']}")
        elif verdict.startswith("with kvpatch only"):
            out.append(f"{result['bucket']}: {verdict}: {f['target']}: {f['invariant']} after {f['operation']}")
        elif verdict.startswith("fixed by") and "on" in f["hunts"]:
            out.append(f"{result['bucket']}: found with kvpatch on, yet {verdict}: {f['target']}: {f['invariant']}")
    return out


def format_text(result: dict[str, Any], *, scripts: bool) -> str:
    lines = [
        f"== {result['bucket']} ({', '.join(f'{d} {v}' for d, v in result['releases'].items())}): "
        f"{len(result['findings'])} findings in {result['seconds']['total']} s"
    ]
    for mode, info in result["hunts"].items():
        counts: dict[str, int] = {}
        for f in result["findings"]:
            if mode in f["hunts"]:
                counts[f["level"]] = counts.get(f["level"], 0) + 1
        covered = sum(1 for a in info.get("architectures", {}).values() if a.get("covered"))
        lines.append(
            f"   hunt with kvpatch {mode}: findings {counts}, {len(info.get('targets', []))} cache classes, "
            f"{covered} architectures covered in {info.get('seconds')} s"
        )
        lines.extend(f"     the process died in {name}: {why}" for name, why in info.get("died", {}).items())
        lines.extend(f"     FAILED: {why}" for why in info.get("failures", []))
    for f in result["findings"]:
        lines.append(
            f"  - [{verdict_of(f)}] {f['target']}: {f['invariant']} after {f['operation']} "
            f"({f['length']} lines; found with kvpatch {'/'.join(f['hunts'])})"
        )
        lines.append(f"      {f['detail']}")
        if scripts or verdict_of(f) == "new":  # a new finding's reproduction is what a maintainer reads first
            lines.extend("      | " + s for s in f["script"].splitlines())
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from ..matrix import BUCKETS, LM_BUCKETS, VLM_BUCKETS

    parser = argparse.ArgumentParser(prog="python -m kvpatch.maint.hunt", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bucket", action="append", default=[], choices=[b.name for b in BUCKETS])
    parser.add_argument("--newest", action="store_true", help="the newest mlx-lm and mlx-vlm buckets")
    parser.add_argument(
        "--upstream", action="store_true", help="the newest mlx-lm and mlx-vlm on the package index (CI's short hunt)"
    )
    parser.add_argument("--report-only", action="store_true", help="exit 0 whatever is found (CI: findings are read)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="seconds per hunt (default %(default)s)")
    parser.add_argument("--levels", default=",".join(LEVELS), help="cache, lazy, model (comma-separated)")
    parser.add_argument("--kvpatch", choices=("both", "off", "on"), default="both", help="which hunts to run")
    parser.add_argument(
        "--only",
        default="",
        metavar="REGEX",
        help="search only the classes (cache level: module.Class) and architectures (model level: module) that match",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-attribute", action="store_true", help="report findings without attributing them")
    parser.add_argument("--scripts", action="store_true", help="print every reproduction (a new one is always printed)")
    parser.add_argument("--json", action="store_true", help=f"machine-readable output (schema {SCHEMA})")
    parser.add_argument("--out", type=Path, help="write <bucket>.json there")
    args = parser.parse_args(argv)
    names = list(args.bucket)
    if args.newest:
        names += [LM_BUCKETS[-1].name, VLM_BUCKETS[-1].name]
    places: list[tuple[str, Any]] = [(name, None) for name in dict.fromkeys(names)]
    if args.upstream:
        places += [(name, (env, releases)) for name, env, releases in newest_places()]
    if not places:
        parser.error("name a --bucket (or --newest, --upstream)")
    modes = ("off", "on") if args.kvpatch == "both" else (args.kvpatch,)
    levels = tuple(x.strip() for x in args.levels.split(",") if x.strip())
    results = []
    failed = False
    for name, place in places:
        result = hunt_bucket(
            name,
            budget=args.budget,
            levels=levels,
            seed=args.seed,
            modes=modes,
            attribute_findings=not args.no_attribute,
            place=place,
            only=args.only,
        )
        failed = failed or any(info.get("failures") for info in result["hunts"].values())
        results.append(result)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{name.replace(' ', '-').replace('+', '')}.json").write_text(
                json.dumps({"schema": SCHEMA, **result}, indent=2), encoding="utf-8"
            )
        if not args.json:
            print(format_text(result, scripts=args.scripts), flush=True)
    found = [p for r in results for p in problems(r)]
    if args.json:
        print(json.dumps({"schema": SCHEMA, "results": results, "problems": found}, indent=2))
    else:
        for p in found:
            print(f"HUNT: {p}")
    if args.report_only:
        return 0
    return 2 if failed else (1 if found else 0)
