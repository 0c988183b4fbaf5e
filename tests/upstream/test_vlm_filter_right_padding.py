"""vlm-filter-right-padding (V10) beyond its reproduction: after filter() during a right-padded prefill, the
next decode step (mask from the cache's own make_mask, attention over the returned keys) equals the kept
rows prefilled alone, for every batch cache class that has prepare(); filter without pending padding is
unchanged."""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_vlm.filter_right_padding import PATCH
from kvpatch.testing import difference

CLASSES = ("BatchKVCache", "BatchRotatingKVCache", "BatchQuantizedKVCache")


pytestmark = pytest.mark.requires_patch(PATCH.id)


def _new(cls_name, rows):
    from mlx_vlm.models import cache as cache_module

    cls = getattr(cache_module, cls_name, None)
    if cls is None or not hasattr(cls, "prepare"):
        pytest.skip(f"{cls_name} has no prepare() in this mlx-vlm")
    if cls_name == "BatchRotatingKVCache":
        return cls(16, [0] * rows)
    if cls_name == "BatchQuantizedKVCache":
        return cls([0] * rows, group_size=32, bits=8)
    return cls([0] * rows)


def _decode(cls_name, keys, lengths, keep, step, queries):
    import mlx.core as mx

    cache = _new(cls_name, len(lengths))
    cache.prepare(right_padding=[keys.shape[2] - n for n in lengths], lengths=lengths)
    cache.update_and_fetch(keys, -keys)
    if keep is not None:
        cache.filter(mx.array(keep))
    cache.finalize()
    mask = cache.make_mask(1, return_array=True)
    k, v = cache.update_and_fetch(step, -step)
    if isinstance(k, tuple):
        k = mx.dequantize(*k, group_size=32, bits=8)
        v = mx.dequantize(*v, group_size=32, bits=8)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=32**-0.5, mask=mask), cache


@pytest.mark.parametrize("cls_name", CLASSES)
def test_decode_after_filter_equals_rows_alone(cls_name):
    import mlx.core as mx

    mx.random.seed(2)
    lengths, keep = [5, 2, 3], [1, 2]
    keys = mx.random.normal((3, 2, 5, 32))
    step = mx.random.normal((2, 2, 1, 32))
    queries = mx.random.normal((2, 2, 1, 32))
    out, cache = _decode(cls_name, keys, lengths, keep, step, queries)
    ref, ref_cache = _decode(cls_name, keys[1:], lengths[1:], None, step, queries)
    assert cache.offset.tolist() == ref_cache.offset.tolist() == [3, 4]
    assert cache.left_padding.tolist() == ref_cache.left_padding.tolist()
    found = difference(out, ref, where="the next decode step")
    assert found.within, found


@pytest.mark.parametrize("cls_name", CLASSES)
def test_filter_without_pending_padding(cls_name):
    import mlx.core as mx

    mx.random.seed(4)
    cache = _new(cls_name, 2)
    keys = mx.random.normal((2, 2, 3, 32))
    cache.update_and_fetch(keys, keys)
    cache.filter(mx.array([0]))
    assert cache.offset.tolist() == [3]
    assert getattr(cache, "_right_padding", None) is None and getattr(cache, "_lengths", None) is None
