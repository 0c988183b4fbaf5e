"""churn-metadata-detach beyond its reproduction: mlx-lm's BatchKVCache, ArraysCache and a CacheList of both keep no
pending metadata graph over 500 join/decode/leave cycles, with values unchanged; composed with the other fixes of
the same methods and attributes (offset-detach's growth tie, arrays-advance-detach's deferred metadata,
batch-filter-unprimed), the metadata is evaluated after they wrote it."""

from __future__ import annotations

import _churn_cases
import pytest

from kvpatch.patches import _churn
from kvpatch.patches.mlx_lm.churn_metadata_detach import PATCH
from kvpatch.testing import require_affected


@pytest.fixture(scope="module", autouse=True)
def _in_range():
    require_affected(PATCH)


def _kinds() -> list[str]:
    import mlx_lm.models.cache as cache

    if hasattr(cache.ArraysCache, "advance") and hasattr(cache.CacheList, "extend"):
        return ["BatchKVCache", "ArraysCache", "CacheList"]
    return ["BatchKVCache"]


@pytest.mark.parametrize("kind", ["BatchKVCache", "ArraysCache", "CacheList"])
def test_churn_keeps_no_pending_metadata(kind):
    import mlx_lm.models.cache as cache

    if kind not in _kinds():
        pytest.skip(f"this mlx-lm has no batched {kind} (hybrid batches: 0.30.4+)")
    _churn_cases.bounded(cache, kind)


@pytest.mark.parametrize("kind", ["BatchKVCache", "ArraysCache", "CacheList"])
def test_churn_values_are_upstreams(kind):
    import mlx_lm.models.cache as cache

    if kind not in _kinds():
        pytest.skip(f"this mlx-lm has no batched {kind} (hybrid batches: 0.30.4+)")
    _churn_cases.same_values(cache, kind, PATCH.id)


def test_unprimed_filter_evaluated_after_the_cap():
    """batch-filter-unprimed rewrites left_padding after upstream's filter (0.31.2+); this patch, outermost, evaluates
    what it wrote: a cache filtered before its first update holds evaluated metadata with the kept row's padding."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    cache = BatchKVCache([0, 3, 1])
    mx.eval(cache.offset, cache.left_padding)
    cache.extend(BatchKVCache([2]))
    assert _churn.pending_edges(cache) == 0
    try:
        cache.filter(mx.array([1, 3]))
    except TypeError:  # 0.28.0-0.31.1 index keys unconditionally: an unprimed filter raises there (not patched)
        pytest.skip("this mlx-lm's BatchKVCache.filter needs keys")
    assert _churn.pending_edges(cache) == 0
    assert cache._idx == 0 and cache.left_padding.tolist() == [3, 2] and cache.offset.tolist() == [-3, -2]
