"""pooling-mask-offset beyond its reproduction: with an int offset, mlx-vlm's BatchPoolingCache.make_mask gives what
it gives for the same offset as an array (the rule ``i < position // ratio``) over several chunk shapes and rows;
array offsets and decode calls get upstream's own result."""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_vlm.pooling_mask_offset import PATCH, chunked_masks
from kvpatch.testing import reproduce, require_affected, without


@pytest.fixture(scope="module", autouse=True)
def _in_range():
    require_affected(PATCH)


def test_reproduction_absent():
    finding = reproduce(PATCH)
    assert not finding.present, finding.detail


@pytest.mark.parametrize(("ratio", "first", "second"), [(4, 16, 8), (4, 12, 9), (2, 6, 5), (8, 32, 20)])
def test_int_offset_mask_follows_the_rule(ratio, first, second):
    from mlx_vlm.models.cache import BatchPoolingCache

    as_int, as_array, rule = chunked_masks(BatchPoolingCache, ratio, first, second)
    assert as_int.reshape(len(rule), -1).tolist() == rule
    assert as_int.tolist() == as_array.tolist()


def test_array_offsets_and_decode_are_upstreams():
    import mlx.core as mx
    from mlx_vlm.models.cache import BatchPoolingCache

    cache = BatchPoolingCache(4, [0, 0])
    kv = mx.random.normal((2, 16, 8), key=mx.random.key(1))
    cache.accumulate_windows(kv, kv, 0)
    cache.update_and_fetch(mx.ones((2, 4, 8)))
    calls = [(6, mx.array([16, 16])), (1, 16), (1, mx.array([16, 16]))]
    with without(PATCH.id):
        expected = [cache.make_mask(L, offset) for L, offset in calls]
    for (L, offset), want in zip(calls, expected, strict=True):
        got = cache.make_mask(L, offset)
        assert (got is None and want is None) or got.tolist() == want.tolist(), (L, offset)
