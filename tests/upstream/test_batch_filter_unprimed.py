"""batch-filter-unprimed (mlx-lm ``BatchKVCache.filter``) beyond its reproduction:

* unprimed left-padded caches filtered to various rows (index array, and a reordering Python list as
  ``PromptProcessingBatch.filter`` passes it), then prefilled and decoded: every step's attention output equals
  that of a cache created with the kept rows;
* filtering a primed cache (the common case) gives exactly what upstream's ``filter`` gives;
* wrapped around a ``filter`` that already caps the shift (mlx-vlm 0.7.8+'s own copy), the delta changes nothing.
"""

from __future__ import annotations

import pytest

from kvpatch.patches import _unprimed
from kvpatch.patches.mlx_lm.batch_filter_unprimed import PATCH
from kvpatch.testing import without

pytestmark = pytest.mark.requires_patch(PATCH.id)


def _steps(rows, *lengths):
    import mlx.core as mx

    keys = mx.random.split(mx.random.key(7), len(lengths))
    return [mx.random.normal((rows, 2, n, 32), key=keys[i]) for i, n in enumerate(lengths)]


@pytest.mark.parametrize(
    ("padding", "keep"),
    [([0, 3, 1], [1, 2]), ([0, 3], [1]), ([2, 0, 4, 1], [3, 0, 2]), ([0, 5, 2], [2, 1])],
    ids=["two-rows", "issue-example", "three-rows", "reordered-list"],
)
def test_unprimed_filter_then_prefill_and_decode_equal_fresh(padding, keep):
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    indices = keep if keep == [2, 1] else mx.array(keep)
    filtered = BatchKVCache(padding)
    filtered.filter(indices)
    fresh = BatchKVCache([padding[i] for i in keep])
    assert filtered._idx == 0
    assert filtered.left_padding.tolist() == fresh.left_padding.tolist()
    assert filtered.offset.tolist() == fresh.offset.tolist()
    for step in _steps(len(keep), 6, 1, 1):
        outs = [_unprimed._attention(c, step, c.update_and_fetch(step, -step)) for c in (filtered, fresh)]
        assert mx.abs(outs[0] - outs[1]).max().item() == 0
    assert filtered._idx == fresh._idx == 8


def test_primed_filter_is_upstreams():
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    results = []
    for patched in (True, False):
        cache = BatchKVCache([2, 0, 3])
        (step,) = _steps(3, 5)
        cache.update_and_fetch(step, -step)
        if patched:
            cache.filter(mx.array([0, 2]))
        else:
            with without(PATCH.id):
                cache.filter(mx.array([0, 2]))
        results.append((cache._idx, cache.left_padding.tolist(), cache.offset.tolist(), cache.keys))
    (idx, pad, offset, keys), (u_idx, u_pad, u_offset, u_keys) = results
    assert (idx, pad, offset) == (u_idx, u_pad, u_offset) == (3, [0, 1], [3, 2])
    assert keys.shape == u_keys.shape and mx.abs(keys - u_keys).max().item() == 0


def test_wraps_a_fixed_filter_unchanged():
    """mlx-vlm 0.7.8+ ships its own BatchKVCache copy with the shift capped at ``_idx``: the delta around that
    fixed ``filter`` gives what the fixed ``filter`` gives alone (unprimed and primed)."""
    import importlib.metadata

    import mlx.core as mx
    from packaging.version import Version

    try:
        version = importlib.metadata.version("mlx-vlm")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("mlx-vlm is not installed: no upstream class with a fixed filter() here")
    if Version(version) < Version("0.7.8"):
        pytest.skip(f"mlx-vlm {version} has no fixed filter() (fixed in 0.7.8)")
    from mlx_vlm.models.cache import BatchKVCache

    with without("batch-filter-unprimed-vlm"):
        fixed = BatchKVCache.filter
    wrapped = _unprimed.cap_shift_at_written(fixed)
    for primed in (False, True):
        results = []
        for function in (fixed, wrapped):
            cache = BatchKVCache([0, 3, 1])
            if primed:
                (step,) = _steps(3, 5)
                cache.update_and_fetch(step, -step)
            function(cache, mx.array([1, 2]))
            results.append((cache._idx, cache.left_padding.tolist(), cache.offset.tolist()))
        assert results[0] == results[1], (primed, results)
