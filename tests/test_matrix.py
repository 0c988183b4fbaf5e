"""The version matrix: ``tests/upstream`` once per bucket of real PyPI releases.

Each bucket's releases are layered (cached under ``~/.cache/kvpatch`` or ``$KVPATCH_CACHE``) over this
test environment, which itself has no mlx, mlx-lm or mlx-vlm. Two buckets run at a time (CI has two
cores). ``KVPATCH_MATRIX`` selects buckets: unset or ``all`` runs every bucket, ``none`` none, or a
comma-separated list of bucket names (``lm-0.23.2,vlm-0.5.0``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from matrix import BUCKETS
from support import REPO, child_env

from kvpatch.maint.envs import Bucket, bucket_environ, build

SELECT = os.environ.get("KVPATCH_MATRIX", "all").strip()
if SELECT in ("", "all"):
    SELECTED = BUCKETS
elif SELECT == "none":
    SELECTED = ()
else:
    wanted = {name.strip() for name in SELECT.split(",") if name.strip()}
    unknown = wanted - {b.name for b in BUCKETS}
    if unknown:
        raise pytest.UsageError(f"KVPATCH_MATRIX names unknown buckets: {sorted(unknown)}")
    SELECTED = tuple(b for b in BUCKETS if b.name in wanted)

JOBS = int(os.environ.get("KVPATCH_MATRIX_JOBS", "2"))


def _run_bucket(bucket: Bucket, workdir: Path) -> tuple[int, str]:
    try:
        build(bucket)
    except Exception as exc:
        return 99, f"building {bucket.name} failed: {exc}"
    # KVPATCH / KVPATCH_DISABLE pass through, so `KVPATCH_DISABLE=<id>` shows a regression test failing.
    passed = {k: os.environ[k] for k in ("KVPATCH", "KVPATCH_DISABLE") if k in os.environ}
    env = bucket_environ(bucket, base=child_env(passed))
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(REPO / "tests" / "upstream"), "-q", "-rfE", "-p", "no:cacheprovider"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def bucket_runs(tmp_path_factory) -> dict[str, Future]:
    pool = ThreadPoolExecutor(max_workers=JOBS)
    base = tmp_path_factory.mktemp("buckets")
    runs = {b.name: pool.submit(_run_bucket, b, base / b.name) for b in SELECTED}
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("bucket", SELECTED, ids=[b.name for b in SELECTED])
def test_bucket(bucket, bucket_runs):
    code, output = bucket_runs[bucket.name].result()
    tail = "\n".join(output.strip().splitlines()[-60:])
    print(f"--- {bucket.name}: {', '.join(bucket.requirements)}\n{tail}")
    assert code == 0, f"bucket {bucket.name} failed (exit {code}):\n{tail}"
