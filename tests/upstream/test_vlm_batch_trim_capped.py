"""vlm-batch-trim-capped (C4, mlx-vlm's copy) beyond its reproduction: mlx-vlm's own ``BatchKVCache`` (from 0.6.4)
under a tiny random-weight llama (hidden 64, 2 layers), as batch-trim-capped's tests drive mlx-lm's:

* rows holding 1 and 5 tokens (``left_padding=[4, 0]``), ``trim(2)``: the next steps give the logits of caches that
  never appended the trimmed tokens (row 0 empty, row 1 its first 3);
* the ordinary speculative rollback (every row appended 3 draft tokens, ``trim(3)``) still gives them;
* the replacement reads no array back to the host.

Without the patch the first fails (offset [-1, 3]):
  KVPATCH_DISABLE=vlm-batch-trim-capped .venv/bin/python scripts/in_bucket.py vlm-0.7.10 -- python -m pytest tests/upstream/test_vlm_batch_trim_capped.py -q   # fails
  .venv/bin/python scripts/in_bucket.py vlm-0.7.10 -- python -m pytest tests/upstream/test_vlm_batch_trim_capped.py -q   # passes
"""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_vlm.batch_trim_capped import PATCH
from kvpatch.testing import difference, tiny_llama

SHORT, LONG = [9], [7, 3, 22, 41, 8]
STEPS = [[11, 12], [30, 31], [40, 41]]

pytestmark = pytest.mark.requires_patch(PATCH.id)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _batch(model, prompts):
    import mlx.core as mx
    from mlx_vlm.models.cache import BatchKVCache

    width = max(map(len, prompts))
    padding = [width - len(p) for p in prompts]
    caches = [BatchKVCache(padding) for _ in model.layers]
    model(mx.array([[0] * pad + p for pad, p in zip(padding, prompts, strict=True)]), cache=caches)
    return caches


def _alone(model, prefix, tokens):
    import mlx.core as mx
    from mlx_vlm.models.cache import KVCache

    caches = [KVCache() for _ in model.layers]
    if prefix:
        model(mx.array([prefix]), cache=caches)
    return [model(mx.array([[t]]), cache=caches)[0, -1] for t in tokens]


def _compare(model, caches, kept):
    """Decode STEPS through ``caches``; row r must match a cache that only ever held ``kept[r]``."""
    import mlx.core as mx

    want = [_alone(model, kept[r], [s[r] for s in STEPS]) for r in range(2)]
    for step, tokens in enumerate(STEPS):
        logits = model(mx.array([[t] for t in tokens]), cache=caches)[:, -1]
        for r in range(2):
            found = difference(logits[r], want[r][step], where=f"row {r}, step {step}, from the never-appended cache")
            assert found.within, found


def test_trim_past_a_short_row(model):
    caches = _batch(model, [SHORT, LONG])
    assert [c.trim(2) for c in caches] == [2, 2]
    assert all(c.offset.tolist() == [0, 3] for c in caches)
    assert all(max(c.left_padding.tolist()) <= c._idx for c in caches)
    _compare(model, caches, [[], LONG[:3]])


def test_ordinary_rollback_unchanged(model):
    import mlx.core as mx

    caches = _batch(model, [SHORT, LONG])
    model(mx.array([[5, 6, 7], [8, 9, 10]]), cache=caches)  # three draft tokens per row, all rejected
    assert [c.trim(3) for c in caches] == [3, 3]
    assert all(c.offset.tolist() == [1, 5] for c in caches)
    _compare(model, caches, [SHORT, LONG])


@pytest.mark.requires_patch(PATCH.id, applies=True)
def test_no_host_sync():
    from mlx_vlm.models.cache import BatchKVCache

    names = set(BatchKVCache.trim.__code__.co_names)
    assert not names & {"item", "tolist", "eval", "async_eval"}, names
