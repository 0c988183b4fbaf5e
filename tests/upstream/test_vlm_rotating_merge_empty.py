"""vlm-rotating-merge-empty (V11) beyond its reproduction: the caller's caches are left as they were, an
empty row between two full ones, rows that were never filled, and an all-empty merge."""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_vlm.rotating_merge_empty import PATCH, _empty_with_storage

pytestmark = pytest.mark.requires_patch(PATCH.id)


def _full(length, seed):
    import mlx.core as mx
    from mlx_vlm.models.cache import RotatingKVCache

    mx.random.seed(seed)
    cache = RotatingKVCache(max_size=32)
    cache.update_and_fetch(mx.random.normal((1, 2, length, 4)), mx.random.normal((1, 2, length, 4)))
    return cache


def test_callers_caches_untouched_and_rows_in_place():
    import mlx.core as mx
    from mlx_vlm.models.cache import BatchRotatingKVCache, RotatingKVCache

    empty = _empty_with_storage(2, 20, 4, 32)
    stored = empty.keys
    rows = [_full(12, 1), empty, _full(20, 2), RotatingKVCache(max_size=32)]
    merged = BatchRotatingKVCache.merge(rows)
    assert empty.keys is stored and empty.offset == 0 and empty._idx == 20
    assert merged.keys.shape == (4, 2, 20, 4)
    assert merged.offset.tolist() == [12, 0, 20, 0]
    assert merged.left_padding.tolist() == [8, 20, 0, 20]
    assert mx.array_equal(merged.keys[0, :, 8:], rows[0].keys[0]).item()
    assert mx.array_equal(merged.keys[2], rows[2].keys[0]).item()
    assert mx.abs(merged.keys[1]).max().item() == 0 and mx.abs(merged.keys[3]).max().item() == 0


def test_all_rows_empty():
    from mlx_vlm.models.cache import BatchRotatingKVCache

    merged = BatchRotatingKVCache.merge([_empty_with_storage(2, 8, 4, 32), _empty_with_storage(2, 8, 4, 32)])
    assert merged.keys is None and merged.offset.tolist() == [0, 0]
