"""batch-filter-unprimed-vlm (mlx-vlm's own ``BatchKVCache`` copy and ``BatchQuantizedKVCache``) beyond its
reproduction:

* unprimed left-padded caches filtered to various rows (index array, reordering Python list), then prefilled and
  decoded: every step's attention output equals that of a cache created with the kept rows;
* filtering a primed cache gives exactly what upstream's ``filter`` gives;
* where mlx-vlm re-exports mlx-lm's ``BatchKVCache`` (<= 0.6.3) this patch leaves that class to
  ``batch-filter-unprimed``.
"""

from __future__ import annotations

import pytest

from kvpatch import get_engine
from kvpatch.patches import _unprimed
from kvpatch.patches.mlx_vlm.batch_filter_unprimed import PATCH, own_batch_kv_cache
from kvpatch.testing import without

pytestmark = pytest.mark.requires_patch(PATCH.id)


def _makers():
    from mlx_vlm.models.cache import BatchQuantizedKVCache

    found = {"BatchQuantizedKVCache": lambda padding: BatchQuantizedKVCache(padding, group_size=32, bits=8)}
    own = own_batch_kv_cache()
    if own is not None:
        found["BatchKVCache"] = own
    return found


def _steps(rows, *lengths):
    import mlx.core as mx

    keys = mx.random.split(mx.random.key(7), len(lengths))
    return [mx.random.normal((rows, 2, n, 64), key=keys[i]) for i, n in enumerate(lengths)]


@pytest.mark.parametrize(
    ("padding", "keep"),
    [([0, 3, 1], [1, 2]), ([0, 3], [1]), ([2, 0, 4, 1], [3, 0, 2]), ([0, 5, 2], [2, 1])],
    ids=["two-rows", "issue-example", "three-rows", "reordered-list"],
)
@pytest.mark.parametrize("cls_name", ["BatchQuantizedKVCache", "BatchKVCache"])
def test_unprimed_filter_then_prefill_and_decode_equal_fresh(cls_name, padding, keep):
    import mlx.core as mx

    make = _makers().get(cls_name)
    if make is None:
        pytest.skip("this mlx-vlm re-exports mlx-lm's BatchKVCache (batch-filter-unprimed covers it)")
    filtered = make(padding)
    filtered.filter(keep if keep == [2, 1] else mx.array(keep))
    fresh = make([padding[i] for i in keep])
    assert filtered._idx == 0
    assert filtered.left_padding.tolist() == fresh.left_padding.tolist()
    for step in _steps(len(keep), 6, 1, 1):
        outs = [_unprimed._attention(c, step, c.update_and_fetch(step, -step)) for c in (filtered, fresh)]
        assert mx.abs(outs[0] - outs[1]).max().item() == 0


@pytest.mark.parametrize("cls_name", ["BatchQuantizedKVCache", "BatchKVCache"])
def test_primed_filter_is_upstreams(cls_name):
    import mlx.core as mx

    make = _makers().get(cls_name)
    if make is None:
        pytest.skip("this mlx-vlm re-exports mlx-lm's BatchKVCache (batch-filter-unprimed covers it)")
    results = []
    for patched in (True, False):
        cache = make([2, 0, 3])
        (step,) = _steps(3, 5)
        cache.update_and_fetch(step, -step)
        if patched:
            cache.filter(mx.array([0, 2]))
        else:
            with without(PATCH.id):
                cache.filter(mx.array([0, 2]))
        results.append((cache._idx, cache.left_padding.tolist(), cache.offset.tolist()))
    assert results[0] == results[1] == (3, [0, 1], [3, 2])


def test_reexported_class_left_to_the_mlx_lm_patch():
    if own_batch_kv_cache() is not None:
        pytest.skip("this mlx-vlm has its own BatchKVCache copy")
    st = get_engine().status[PATCH.id]
    assert all(t.qualname != "BatchKVCache.filter" for t in st.installed)
