"""The version matrix: ``tests/upstream`` once per bucket of real PyPI releases.

Each bucket's releases are layered (cached under ``~/.cache/kvpatch`` or ``$KVPATCH_CACHE``) over this
test environment, which itself has no mlx, mlx-lm or mlx-vlm. Two buckets run at a time (CI has two
cores), started as soon as the session's tests are collected, so they run while this process runs the unit
tests. A bucket runs what tests/tiers.py gives it: the patch tier everywhere, the integration tier in the
buckets it names (those start first: they take longest). ``KVPATCH_MATRIX`` selects buckets: unset or ``all``
runs every bucket (under ``KVPATCH_TIER=quick``: the newest mlx-lm and mlx-vlm ones), ``newest`` those two,
``none`` none, or a comma-separated list of bucket names (``lm-0.23.2,vlm-0.5.0``).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import tiers
from matrix import BUCKETS, BY_NAME
from support import CPU_LINE, MATRIX_RESULTS, MATRIX_SELECTED, REPO, child_env, skip_if_no_index

from kvpatch.maint.envs import PINNED_ROOT, Bucket, bucket_environ, build, cache_dir, is_cached, layer

SELECT = os.environ.get("KVPATCH_MATRIX", "newest" if tiers.quick() else "all").strip()
if SELECT in ("", "all"):
    SELECTED = BUCKETS
elif SELECT == "newest":
    SELECTED = tuple(BY_NAME[name] for name in tiers.NEWEST)
elif SELECT == "none":
    SELECTED = ()
else:
    wanted = {name.strip() for name in SELECT.split(",") if name.strip()}
    unknown = wanted - {b.name for b in BUCKETS}
    if unknown:
        raise pytest.UsageError(f"KVPATCH_MATRIX names unknown buckets: {sorted(unknown)}")
    SELECTED = tuple(b for b in BUCKETS if b.name in wanted)

JOBS = int(os.environ.get("KVPATCH_MATRIX_JOBS", "2"))
LAYER_JOBS = 4
#: Each started bucket's work folder (its pytest.log holds the bucket's whole output).
WORKDIRS: dict[str, Path] = {}
#: _run_bucket's exit code when the bucket's layers could not be built (pytest's own codes are 0-5).
BUILD_FAILED = 99


def _session_env() -> dict[str, str]:
    """The buckets' base environment, read once when they are started (before any test runs): a bucket starting later
    must not inherit what a unit test beside it sets for a moment (``KVPATCH=off`` turned a whole bucket's patches
    off). KVPATCH / KVPATCH_DISABLE pass through, so `KVPATCH_DISABLE=<id>` shows a regression test failing."""
    passed = {k: os.environ[k] for k in ("KVPATCH", "KVPATCH_DISABLE", tiers.TIER_VAR) if k in os.environ}
    return child_env({**passed, tiers.SELECT_VAR: "1"})


def _pinned(root: Path, run, *args):
    """``run(*args)`` in a thread that reads the layer cache at ``root`` whatever ``os.environ`` says meanwhile."""
    context = contextvars.copy_context()
    context.run(PINNED_ROOT.set, root)
    return context.run(run, *args)


def _run_bucket(bucket: Bucket, workdir: Path, base: dict[str, str]) -> tuple[int, str, float]:
    started = time.monotonic()
    try:
        build(bucket)
    except Exception as exc:
        return BUILD_FAILED, f"building {bucket.name} failed: {exc}", time.monotonic() - started
    env = bucket_environ(bucket, base=base)
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(REPO / "tests" / "upstream"), "-q", "-rfE", "-p", "no:cacheprovider"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    output = proc.stdout + proc.stderr
    # the whole output stays beside the bucket's work folder: a failure's message shows only its first lines
    (workdir / "pytest.log").write_text(output, encoding="utf-8")
    return proc.returncode, output, time.monotonic() - started


def _say(config: pytest.Config, text: str) -> None:
    """A progress line on the terminal now, whatever pytest captures (-q or not, -s or not)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    capture = config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        reporter.write_line(text)


_SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+(?: \w+)?,? ?)+) in [\d.]+s")


def summary_line(output: str) -> str:
    """pytest's closing line in a bucket's output ("230 passed, 12 skipped"), or ""."""
    for line in reversed(output.strip().splitlines()):
        match = _SUMMARY.match(line.strip())
        if match:
            return match.group(1).strip().rstrip(",")
    return ""


_RUNS = pytest.StashKey[dict]()


def start(config: pytest.Config, names: list[str], base: Path) -> None:
    """Start the buckets ``names`` (once per session), JOBS at a time, those with integration tests first."""
    if _RUNS in config.stash:
        return
    chosen = [b for b in SELECTED if b.name in names]
    busy = {name for where in tiers.INTEGRATION.values() for name in where}
    chosen.sort(key=lambda b: b.name not in busy or tiers.quick())  # (stable: matrix order otherwise)
    root, env = cache_dir(), _session_env()
    config.stash[MATRIX_SELECTED] = len(chosen)
    config.stash[MATRIX_RESULTS] = {}
    layers = {req for b in chosen for req in b.requirements}
    missing = sorted(req for req in layers if not is_cached(req))
    _say(
        config,
        f"[matrix] {len(chosen)} of {len(BUCKETS)} buckets, {JOBS} at a time; layers: {len(layers) - len(missing)} "
        f"cached in {cache_dir()}, {len(missing)} to download and build"
        + (f" ({', '.join(missing[:6])}{', ...' if len(missing) > 6 else ''})" if missing else ""),
    )
    if missing:
        # Building a layer is mostly download and disk: LAYER_JOBS at a time, in the buckets' order, while the buckets
        # run (a bucket waits on the per-layer lock for a layer being built; a failed build is reported by it).
        builders = ThreadPoolExecutor(max_workers=LAYER_JOBS)
        for req in dict.fromkeys(req for b in chosen for req in b.requirements if req in missing):
            builders.submit(_pinned, root, _prefetch, req)
        config.add_cleanup(lambda: builders.shutdown(wait=True, cancel_futures=True))
    pool = ThreadPoolExecutor(max_workers=JOBS)
    WORKDIRS.update({b.name: base / b.name for b in chosen})
    config.stash[_RUNS] = {b.name: pool.submit(_pinned, root, _run_bucket, b, WORKDIRS[b.name], env) for b in chosen}
    config.add_cleanup(lambda: pool.shutdown(wait=True, cancel_futures=True))


def _prefetch(requirement: str) -> None:
    with contextlib.suppress(Exception):  # the bucket that needs it builds it again and reports the error
        layer(requirement)


@pytest.fixture(scope="session")
def bucket_runs(request, tmp_path_factory) -> dict[str, Future]:
    """The selected buckets' runs (tests/conftest.py starts them right after collection)."""
    start(request.config, [b.name for b in SELECTED], tmp_path_factory.mktemp("buckets"))
    return request.config.stash[_RUNS]


@pytest.mark.parametrize("bucket", SELECTED, ids=[b.name for b in SELECTED])
def test_bucket(bucket, bucket_runs, request):
    code, output, seconds = bucket_runs[bucket.name].result()
    results = request.config.stash[MATRIX_RESULTS]
    results[bucket.name] = (code, summary_line(output))
    verdict = "ok" if code == 0 else f"FAILED (exit {code})"
    cpu = re.search(rf"{re.escape(CPU_LINE)} (\d+) s", output)
    _say(
        request.config,
        f"[matrix {len(results)}/{request.config.stash[MATRIX_SELECTED]}] {bucket.name}: {verdict}: "
        f"{summary_line(output) or 'no summary'} ({seconds:.0f} s"
        + (f", tests' cpu {cpu.group(1)} s)" if cpu else ")"),
    )
    tail = "\n".join(output.strip().splitlines()[-60:])
    print(f"--- {bucket.name}: {', '.join(bucket.requirements)}\n{tail}")
    if code == BUILD_FAILED:
        # an offline host (no package index) can only run buckets whose layers are cached; under CI this fails
        missing = [req for req in bucket.requirements if not is_cached(req)]
        skip_if_no_index(output, f"bucket {bucket.name} (layers not cached: {', '.join(missing) or 'none'})")
    if code != 0:
        # the first failures, not only the last ones: a bucket where every patch test fails shows what went first
        lines = output.strip().splitlines()
        first = [line for line in lines if line.startswith(("FAILED ", "ERROR "))][:20]
        log = WORKDIRS[bucket.name] / "pytest.log"
        pytest.fail(
            f"bucket {bucket.name} failed (exit {code}); whole output: {log}\n" + "\n".join(first) + f"\n{tail}"
        )
