"""``kvpatch.require`` / ``kvpatch.is_fixed`` on real releases (tests/engine/test_guarantees.py has the table).

``batch-logits-processors`` applies to mlx-lm 0.31.2-0.31.x and is fixed upstream from 0.32.0: in the
``lm-0.31.3`` bucket it must be applied (and reached) for ``require`` to pass, in ``lm-0.32.2`` upstream has
the fix and ``require`` passes even with kvpatch's patch switched off. Each check starts a child process,
so this runs in those two buckets only (or outside the matrix).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
from packaging.version import Version
from support import child_env

import kvpatch

ID = "batch-logits-processors"
BUCKETS = ("lm-0.31.3", "lm-0.32.2")  # the newest release with the bug, the newest release

pytestmark = pytest.mark.skipif(
    os.environ.get("KVPATCH_BUCKET", BUCKETS[0]) not in BUCKETS, reason=f"runs in the {' and '.join(BUCKETS)} buckets"
)
CODE = """
import importlib, kvpatch
importlib.import_module("mlx_lm.generate")
print("IS_FIXED", kvpatch.is_fixed("batch-logits-processors"))
try:
    kvpatch.require("batch-logits-processors", "qsdpa-gqa-batch-mask")
    print("REQUIRE ok")
except kvpatch.NotFixed as exc:
    print("REQUIRE raised", [g.patch_id for g in exc.problems])
    print(exc)
"""


def _mlx_lm() -> Version:
    return Version(importlib.metadata.version("mlx-lm"))


def _run(**env: str) -> str:
    proc = subprocess.run([sys.executable, "-c", CODE], env=child_env(env), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture
def affected():
    version = _mlx_lm()
    if not Version("0.31.2") <= version < Version("0.32.0"):
        pytest.skip(f"{ID} applies to mlx-lm 0.31.2-0.31.x; this is {version}")


@pytest.fixture
def fixed_upstream():
    version = _mlx_lm()
    if version < Version("0.32.0"):
        pytest.skip(f"mlx-lm {version} has the {ID} bug")


def test_require_passes_where_the_patch_is_applied_and_fails_where_it_is_off(affected):
    out = _run()
    assert "IS_FIXED True" in out and "REQUIRE ok" in out, out
    out = _run(KVPATCH_DISABLE=ID)
    assert "IS_FIXED False" in out, out
    assert f"REQUIRE raised ['{ID}']" in out, out
    assert f"{ID}: NOT FIXED: disabled: disabled by KVPATCH_DISABLE names {ID}" in out, out
    assert "qsdpa-gqa-batch-mask: ok: applied" in out, out  # every id is listed with its state
    out = _run(KVPATCH="off")
    assert "REQUIRE raised ['batch-logits-processors', 'qsdpa-gqa-batch-mask']" in out, out


def test_require_passes_where_upstream_fixed_it_even_with_the_patch_off(fixed_upstream):
    for env in ({}, {"KVPATCH_DISABLE": ID}, {"KVPATCH": "off"}):
        out = _run(**env)
        assert "IS_FIXED True" in out and "REQUIRE ok" in out, (env, out)


def test_a_server_replacement_over_the_fix_makes_require_fail(affected):
    """ "Applied" means reached now: a server that replaces kvpatch's replacement without calling it."""
    generate = importlib.import_module("mlx_lm.generate")
    assert kvpatch.is_fixed(ID)
    owner = generate.PromptProcessingBatch
    ours = vars(owner)["extend"]

    def extend(self, batch):  # a server's own copy that never calls kvpatch's
        return None

    owner.extend = extend
    try:
        assert kvpatch.is_fixed(ID) is False
        with pytest.raises(kvpatch.NotFixed, match=f"{ID}: NOT FIXED: overridden"):
            kvpatch.require(ID)
    finally:
        owner.extend = ours
    assert kvpatch.is_fixed(ID)
    assert [g.state for g in kvpatch.require(ID)] == ["applied"]


def test_unknown_id_suggests_the_right_one():
    with pytest.raises(kvpatch.UnknownPatch, match="did you mean 'batch-logits-processors'"):
        kvpatch.require("batch-logit-processor")
