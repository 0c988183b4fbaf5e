"""The hunt can fail: a bug planted in upstream's BatchKVCache is found and shrunk to a few operations, the lazy
metadata drive finds the offset growth kvpatch fixes (and not with kvpatch on), a catalogue bug's reproduction is
attributed to its patch, and the model level drives an mRoPE language model with the inputs its model gives each
prompt (a planted loss of them is found, and nothing without it). Each runs in a child process of a matrix bucket (integration tier, named in
tests/tiers.py's INTEGRATION_HERE: minutes, not the quick tier)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from matrix import BY_NAME
from support import child_env, skip_if_no_index

from kvpatch.maint.envs import Bucket, EnvBuildError, bucket_environ

pytest.importorskip("hypothesis", reason="the bug hunt needs hypothesis (the test dependency group)")

NEWEST_LM = "lm-0.32.2"

#: A filter that drops the first kept row's offset (sets it to 0): the planted bug.
PLANT = """
import mlx.core as mx
import mlx_lm.models.cache as c
original = c.BatchKVCache.filter
def filter(self, indices):
    original(self, indices)
    self.offset = mx.concatenate([mx.zeros_like(self.offset[:1]), self.offset[1:]])
c.BatchKVCache.filter = filter
"""

HUNT = """
import json, sys
from kvpatch.maint.hunt import search, targets
plant = sys.argv[1] == "plant"
if plant:
    exec(PLANT)
found, _ = targets.discover(("mlx_lm",))
target = next(t for t in found if t.name == "BatchKVCache")
outcome = search.hunt_target(target, float(sys.argv[2]), seed=0)
print("@@" + json.dumps([
    {"invariant": c.violation.invariant, "operation": c.violation.operation, "lines": c.lines} for c in outcome.caught
]))
"""


def _bucket_env(bucket: Bucket, base: dict[str, str]) -> dict[str, str]:
    """The bucket's environment; skipped on a host with no package index to layer it from (the GPU machine)."""
    try:
        return bucket_environ(bucket, base=base)
    except EnvBuildError as exc:
        skip_if_no_index(str(exc), f"bucket {bucket.name}")
        raise


def _child(code: str, *args: str, kvpatch: str = "on", bucket: str = NEWEST_LM, timeout: float = 900) -> str:
    env = _bucket_env(BY_NAME[bucket], child_env({"KVPATCH": "off"} if kvpatch == "off" else {}))
    proc = subprocess.run(
        [sys.executable, "-P", "-c", code, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return next(line for line in proc.stdout.splitlines() if line.startswith("@@"))[2:]


def test_planted_filter_bug_is_found_and_shrunk():
    # kvpatch on: upstream's own filter bugs are patched on this release, so a filter finding is the planted one
    code = f"PLANT = {PLANT!r}\n{HUNT}"
    planted = json.loads(_child(code, "plant", "40"))
    filtered = [c for c in planted if _filters(c)]
    assert filtered, planted
    shortest = min(filtered, key=lambda c: len(c["lines"]))
    lines = shortest["lines"]
    # shrunk: what is left makes two rows (or one and a joined one), may feed them, and filters; every operation
    # the planted bug does not need (trim, merge, extract, restores, save/load, nbytes, more steps) is gone
    needless = ("trim(", "merge(", "extract(", "restore(", "snapshot(", "save_prompt_cache", "nbytes", "dequantize")
    assert not [line for line in lines if any(word in line for word in needless)], lines
    assert len(lines) <= 10, lines
    clean = json.loads(_child(code, "clean", "40"))
    assert not [c for c in clean if _filters(c)], clean


def _filters(caught: dict) -> bool:
    """A finding of the planted bug: rows or offsets wrong in a sequence that filters, seen at the filter or, where
    the dropped offset is still pending left padding (an unprimed row), at the next step that uses it."""
    return caught["invariant"] in ("offsets-agree", "rows-agree") and any("cache.filter(" in x for x in caught["lines"])


LAZY = """
import json
from kvpatch.maint.hunt import lazy, targets
found, _ = targets.discover(("mlx_lm",))
target = next(t for t in found if t.name == "BatchKVCache")
print("@@" + json.dumps([c.violation.detail for c in lazy.drive(target)]))
"""


def test_lazy_drive_finds_the_offset_growth_and_not_with_kvpatch_on():
    off = json.loads(_child(LAZY, kvpatch="off"))
    assert any("offset" in detail and "decode" in detail for detail in off), off
    assert json.loads(_child(LAZY, kvpatch="on")) == []


#: The shape of the hunt's reproduction of catalogue C4 (BatchKVCache.trim over-trims a short row), as it wrote it.
C4 = """\
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

cache = BatchKVCache(left_padding=[2, 0])
rows = [KVCache(), KVCache()]
k = mx.random.normal((2, 2, 3, 8), key=mx.random.key(0))
cache.update_and_fetch(k, k)
rows[0].update_and_fetch(k[:1, :, 2:], k[:1, :, 2:])
rows[1].update_and_fetch(k[1:], k[1:])
cache.trim(2)
for r in rows:
    r.trim(2)
print('batch offsets:', cache.offset.tolist(), 'each row alone:', [r.offset for r in rows])
assert cache.offset.tolist() == [r.offset for r in rows]
"""


def test_attribution_names_the_patch_that_fixes_a_catalogue_bug():
    from kvpatch.maint.hunt import attribute
    from kvpatch.registry import load

    bucket = BY_NAME["lm-0.31.3"]
    env = _bucket_env(bucket, child_env())
    finding = {"script": C4, "invariant": "offsets-agree", "target": "mlx_lm.models.cache.BatchKVCache"}
    releases = {"mlx-lm": bucket.version("mlx-lm"), "mlx-vlm": None}
    result = attribute.attribute(finding, env, load().patches, releases)
    assert result.verdict == "fixed by batch-trim-capped", result


#: Qwen3.5's text prompts given no positions by ``get_input_embeddings`` (the bug of qwen3_5_text and paddleocr_vl's
#: own text path, planted in qwen3_5, whose text path gives them): the model level drives an mRoPE language model
#: with what that method gives each prompt, as mlx-vlm's server does.
VLM_PLANT = """
import mlx_vlm.models.qwen3_5 as q
original = q.Model.get_input_embeddings
def get_input_embeddings(self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    out.position_ids = out.rope_deltas = None
    return out
q.Model.get_input_embeddings = get_input_embeddings
"""

VLM_HUNT = """
import json, sys, time
from kvpatch.maint.hunt import models
if sys.argv[1] == "plant":
    exec(VLM_PLANT)
caught, why = models.one("mlx_vlm", "qwen3_5", models.Driver("mlx_vlm", time.monotonic() + 300, 0))
print("@@" + json.dumps([why, caught and caught.violation.invariant]))
"""


def test_model_level_drives_mrope_models_with_their_prompt_inputs():
    # kvpatch off: the finding, if any, is upstream's alone
    code = f"VLM_PLANT = {VLM_PLANT!r}\n{VLM_HUNT}"
    assert json.loads(_child(code, "plant", kvpatch="off", bucket="vlm-0.7.10")) == [None, "logits-agree"]
    assert json.loads(_child(code, "clean", kvpatch="off", bucket="vlm-0.7.10")) == [None, None]
