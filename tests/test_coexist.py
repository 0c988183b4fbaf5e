"""Coexistence buckets: ``tests/coexist`` once per downstream server (tests/matrix.py COEXIST_BUCKETS).

The whole test command runs them at level 1 (the quick tier does not: runners are not in it): the issue-11
scenarios (both import orders), the server test files aimed at the attributes both patch, and the servers' fix
test files with the server fixes kvpatch replaces switched off (tests/coexist/server_fixes.py), which must match
the run with them on: about a minute per bucket. ``KVPATCH_COEXIST=full`` also runs every server test file that
touches mlx-lm / mlx-vlm caches (longer); ``0`` none; ``coexist-rapid-mlx`` (a bucket name list) those buckets.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from matrix import COEXIST_BUCKETS
from support import REPO, child_env, skip_if_no_index

from kvpatch.maint.envs import bucket_environ, build

LEVEL = os.environ.get("KVPATCH_COEXIST", "1").strip().lower()
if LEVEL in ("0", "off", "no", "none"):
    SELECTED: tuple = ()
elif LEVEL in ("1", "on", "yes", "full", "all"):
    SELECTED = COEXIST_BUCKETS
else:
    wanted = {name.strip() for name in LEVEL.split(",") if name.strip()}
    unknown = wanted - {b.name for b in COEXIST_BUCKETS}
    if unknown:
        raise pytest.UsageError(f"KVPATCH_COEXIST names unknown buckets: {sorted(unknown)}")
    SELECTED = tuple(b for b in COEXIST_BUCKETS if b.name in wanted)


@pytest.mark.skipif(not SELECTED, reason="KVPATCH_COEXIST=0 leaves the coexistence buckets out")
@pytest.mark.parametrize("bucket", SELECTED or COEXIST_BUCKETS, ids=[b.name for b in SELECTED or COEXIST_BUCKETS])
def test_coexist_bucket(bucket, tmp_path):
    try:
        build(bucket)
    except Exception as exc:
        skip_if_no_index(str(exc), f"coexistence bucket {bucket.name}")
        raise
    passed = {k: os.environ[k] for k in ("KVPATCH", "KVPATCH_DISABLE", "KVPATCH_COEXIST") if k in os.environ}
    env = bucket_environ(bucket, base=child_env(passed))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(REPO / "tests" / "coexist"), "-q", "-rfE", "-p", "no:cacheprovider"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-60:])
    print(f"--- {bucket.name}: {', '.join(bucket.requirements)}\n{tail}")
    assert proc.returncode == 0, f"bucket {bucket.name} failed (exit {proc.returncode}):\n{tail}"
