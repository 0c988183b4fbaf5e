"""batch-extract-right-padding (mlx-lm ``BatchKVCache`` / ``BatchRotatingKVCache.extract``) beyond its reproduction:

* a row extracted at any point of a chunked right-padded prefill equals its real tokens prefilled alone: after
  all its pads (one chunk, 3 + 2, 4 + 1), before any of them (3 columns: mlx-vlm's APC checkpoints extract
  there, upstream is right and must stay right), and after some (4 columns);
* ``prepare(right_padding=...)`` without ``lengths`` (the speculative-rollback use, pads already written):
  every declared pad counts as written, as ``finalize`` assumes;
* extracting does not change the live batch: after ``finalize`` it decodes exactly like a batch never extracted;
* with a row dropped mid-prefill (``filter``, a reordering list as ``PromptProcessingBatch`` passes it) the
  kept rows still extract right (needs ``lm-filter-right-padding`` where that bug is present).
"""

from __future__ import annotations

import pytest

from kvpatch.patches import _right_padding
from kvpatch.patches._numbers import exact
from kvpatch.patches.mlx_lm.batch_extract_right_padding import PATCH
from kvpatch.testing import skip_unless_in_place

pytestmark = pytest.mark.requires_patch(PATCH.id)


def _classes():
    from mlx_lm.models import cache as cache_module

    return {
        "BatchKVCache": (lambda n: cache_module.BatchKVCache([0] * n), cache_module.KVCache),
        "BatchRotatingKVCache": (
            lambda n: cache_module.BatchRotatingKVCache(16, [0] * n),
            lambda: cache_module.RotatingKVCache(16),
        ),
    }


CHUNKS = [(5,), (3, 2), (3,), (4,), (2, 2), (4, 1)]


@pytest.mark.parametrize("chunks", CHUNKS, ids=["+".join(map(str, c)) for c in CHUNKS])
@pytest.mark.parametrize("cls_name", ["BatchKVCache", "BatchRotatingKVCache"])
def test_extract_at_any_prefill_point_equals_row_alone(cls_name, chunks):
    if cls_name == "BatchRotatingKVCache" and 1 in chunks:
        pytest.skip("mlx-lm's BatchRotatingKVCache rejects a 1-token update while right padding is pending")
    one = {cls_name: _classes()[cls_name]}
    finding = _right_padding.extract_finding(one, (chunks,))
    assert finding.bug == "absent", finding.detail
    finding = _right_padding.extract_finding(one, (chunks,), lengths=(5, 2, 4))
    assert finding.bug == "absent", finding.detail


def _keys(rows, width, seed=3):
    import mlx.core as mx

    return mx.random.normal((rows, 2, width, 64), key=mx.random.key(seed))


def test_right_padding_without_lengths_counts_every_pad():
    from mlx_lm.models.cache import BatchKVCache

    keys = _keys(2, 5)
    cache = BatchKVCache([0, 0])
    cache.update_and_fetch(keys, -keys)
    cache.prepare(right_padding=[2, 0])  # the pads are already written (speculative-rollback style)
    row = cache.extract(0)
    assert row.offset == 3 and row.keys.shape[2] == 3
    assert cache.extract(1).offset == 5


@pytest.mark.parametrize("cls_name", ["BatchKVCache", "BatchRotatingKVCache"])
def test_extract_leaves_the_batch_as_it_was(cls_name):
    import mlx.core as mx

    make_batch, _ = _classes()[cls_name]
    keys, step = _keys(2, 5), _keys(2, 1, seed=4)
    outs = []
    for extract in (True, False):
        cache = make_batch(2)
        cache.prepare(right_padding=[2, 0], lengths=[3, 5])
        cache.update_and_fetch(keys, -keys)
        if extract:
            assert cache.extract(0).offset == 3
            assert cache.extract(1).offset == 5
        cache.finalize()
        state = (cache.offset.tolist(), cache.left_padding.tolist(), cache._idx)
        mask = cache.make_mask(1, return_array=True)
        k, v = cache.update_and_fetch(step, -step)
        outs.append((state, mx.fast.scaled_dot_product_attention(step, k, v, scale=0.125, mask=mask)))
    (state, out), (ref_state, ref_out) = outs
    assert state == ref_state
    assert exact(out, ref_out)


@pytest.mark.parametrize("cls_name", ["BatchKVCache", "BatchRotatingKVCache"])
def test_extract_after_filter_mid_prefill(cls_name):
    import mlx.core as mx

    skip_unless_in_place("lm-filter-right-padding", "the pending-padding filter bug (L-V10)")
    make_batch, make_alone = _classes()[cls_name]
    lengths = [5, 2, 4]
    keys = _keys(3, 5)
    cache = make_batch(3)
    cache.prepare(right_padding=[5 - n for n in lengths], lengths=lengths)
    cache.update_and_fetch(keys[:, :, :3], -keys[:, :, :3])
    cache.filter([2, 1])
    cache.update_and_fetch(keys[mx.array([2, 1]), :, 3:], -keys[mx.array([2, 1]), :, 3:])
    for row, original in enumerate([2, 1]):
        got = cache.extract(row)
        alone = make_alone()
        part = keys[original : original + 1, :, : lengths[original]]
        alone.update_and_fetch(part, -part)
        assert got.offset == alone.offset == lengths[original]
        assert exact(got.keys[..., : got.offset, :], alone.keys[..., : alone.offset, :])
