"""batch-extract-right-padding-vlm (mlx-vlm's own ``BatchKVCache``, ``BatchRotatingKVCache``,
``BatchQuantizedKVCache``) beyond its reproduction:

* a row extracted at any point of a chunked right-padded prefill equals its real tokens prefilled alone: after
  all its pads, before any of them (where mlx-vlm's own APC checkpoints extract: upstream is right and stays
  right), and after some;
* extracting does not change the live batch: after ``finalize`` it decodes exactly like a batch never extracted;
* a row dropped mid-prefill (``filter``, as ``PromptProcessingBatch.remove`` does) leaves the kept rows
  extracting right.
"""

from __future__ import annotations

import pytest

from kvpatch.patches import _right_padding
from kvpatch.patches._numbers import exact
from kvpatch.patches.mlx_vlm.batch_extract_right_padding import PATCH, classes
from kvpatch.testing import skip_unless_in_place

pytestmark = pytest.mark.requires_patch(PATCH.id)


NAMES = ["BatchKVCache", "BatchRotatingKVCache", "BatchQuantizedKVCache"]
CHUNKS = [(5,), (3, 2), (3,), (4,), (2, 2), (4, 1)]


def _class(name):
    found = classes().get(name)
    if found is None:
        pytest.skip(f"this mlx-vlm has no {name} of its own with extract()")
    return found


@pytest.mark.parametrize("chunks", CHUNKS, ids=["+".join(map(str, c)) for c in CHUNKS])
@pytest.mark.parametrize("cls_name", NAMES)
def test_extract_at_any_prefill_point_equals_row_alone(cls_name, chunks):
    one = {cls_name: _class(cls_name)}
    try:
        finding = _right_padding.extract_finding(one, (chunks,))
    except RuntimeError as exc:
        if "finalize() should be called" not in str(exc):
            raise
        pytest.skip(f"this release rejects a 1-token update while right padding is pending: {exc}")
    assert finding.bug == "absent", finding.detail
    finding = _right_padding.extract_finding(one, (chunks,), lengths=(5, 2, 4))
    assert finding.bug == "absent", finding.detail


def _keys(rows, width, seed=3):
    import mlx.core as mx

    return mx.random.normal((rows, 2, width, 64), key=mx.random.key(seed))


@pytest.mark.parametrize("cls_name", NAMES)
def test_extract_leaves_the_batch_as_it_was(cls_name):
    import mlx.core as mx

    make_batch, _ = _class(cls_name)
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
        k, v = (_right_padding._floats(cache, x) for x in cache.update_and_fetch(step, -step))
        mask = mx.arange(k.shape[2])[None, None, None, :] >= cache.left_padding[:, None, None, None]
        outs.append((state, mx.fast.scaled_dot_product_attention(step, k, v, scale=0.125, mask=mask)))
    (state, out), (ref_state, ref_out) = outs
    assert state == ref_state
    assert exact(out, ref_out)


@pytest.mark.parametrize("cls_name", NAMES)
def test_extract_after_filter_mid_prefill(cls_name):
    import mlx.core as mx

    skip_unless_in_place("vlm-filter-right-padding", "the pending-padding filter bug (V10)")
    make_batch, make_alone = _class(cls_name)
    lengths = [5, 2, 4]
    keys = _keys(3, 5)
    cache = make_batch(3)
    cache.prepare(right_padding=[5 - n for n in lengths], lengths=lengths)
    cache.update_and_fetch(keys[:, :, :3], -keys[:, :, :3])
    cache.filter(mx.array([2, 1], mx.int32))
    kept = keys[mx.array([2, 1])]
    cache.update_and_fetch(kept[:, :, 3:], -kept[:, :, 3:])
    for row, original in enumerate([2, 1]):
        got = cache.extract(row)
        alone = make_alone()
        part = keys[original : original + 1, :, : lengths[original]]
        alone.update_and_fetch(part, -part)
        assert got.offset == alone.offset == lengths[original]
        got_keys, alone_keys = _right_padding._valid_keys(got), _right_padding._valid_keys(alone)
        assert exact(got_keys, alone_keys)
