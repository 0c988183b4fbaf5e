"""tq-batch-prepare beyond its reproduction: the added ``prepare()``/``finalize()`` keep ``BatchKVCache``'s
contract for every caller that now finds them (the capability checks in mlx-vlm flip for TurboQuant caches):

* the same sequence of calls gives a ``BatchTurboQuantKVCache`` the ``offset`` / ``left_padding`` / ``_idx``
  that ``BatchKVCache`` gets (left padding on an empty cache; right padding, a prefill, finalize; a decode);
* after finalize each row's dequantized keys/values equal a single-row TurboQuant cache fed that row alone,
  including a finalize on a cache that already held tokens (LFM2's ragged rollback, ``speculative/
  cache_state.py``: prepare(right_padding=...) then finalize() on a filled cache);
* ``prepare(left_padding=...)`` on a filled cache raises ``ValueError`` as ``BatchKVCache``'s does; finalize
  without a prepare is a no-op.
"""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_vlm.tq_batch_prepare import PATCH
from kvpatch.testing import exact

pytestmark = pytest.mark.requires_patch(PATCH.id)


@pytest.fixture(scope="module", autouse=True)
def _applied():
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    if not hasattr(BatchTurboQuantKVCache, "prepare"):
        pytest.skip("tq-batch-prepare is not applied here (KVPATCH_DISABLE?): its reproduction shows the bug")


def _kv(rows, tokens, seed):
    import mlx.core as mx

    shape = (rows, 2, tokens, 32)
    return mx.random.normal(shape, key=mx.random.key(seed)), mx.random.normal(shape, key=mx.random.key(seed + 100))


def _meta(cache):
    return cache.offset.tolist(), cache.left_padding.tolist(), cache._idx


def _lifecycle(cache):
    """What the APC mixed prefill does: prepare(right_padding), a right-padded prefill, finalize, one decode."""
    cache.prepare(left_padding=[1, 0])
    k, v = _kv(2, 6, 0)
    cache.prepare(right_padding=[0, 3], lengths=[5, 3])
    cache.update_and_fetch(k, v)
    cache.finalize()
    k, v = _kv(2, 1, 1)
    cache.update_and_fetch(k, v)
    return cache


def test_same_bookkeeping_as_batch_kv_cache():
    from mlx_vlm.models.cache import BatchKVCache
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    if not BatchKVCache.__module__.startswith("mlx_vlm.") or not hasattr(BatchKVCache, "finalize"):
        pytest.skip("mlx-vlm's own BatchKVCache with prepare/finalize is the reference (0.6.4+)")
    tq = _lifecycle(BatchTurboQuantKVCache([0, 0], bits=3.5))
    dense = _lifecycle(BatchKVCache([0, 0]))
    assert _meta(tq) == _meta(dense)
    assert tq.make_mask(1, return_array=True).tolist() == dense.make_mask(1, return_array=True).tolist()


def _rows_equal_alone(cache, rows):
    """Each row's valid positions equal a single-row TurboQuant cache fed that row's tokens alone."""
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    keys, values = cache.dequantize()
    for row, (k, v) in enumerate(rows):
        alone = BatchTurboQuantKVCache([0], bits=3.5)
        alone.update_and_fetch(k, v)
        a_keys, a_values = alone.dequantize()
        start = cache.left_padding[row].item()
        assert cache.offset[row].item() == k.shape[2]
        got_k, got_v = keys[row : row + 1, :, start : cache._idx], values[row : row + 1, :, start : cache._idx]
        assert exact(got_k, a_keys) and exact(got_v, a_values), f"row {row}"


def test_finalize_rolls_each_row_like_the_row_alone():
    import mlx.core as mx
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    k, v = _kv(2, 7, 3)
    cache = BatchTurboQuantKVCache([0, 0], bits=3.5)
    cache.prepare(right_padding=[0, 4], lengths=[7, 3])
    cache.update_and_fetch(k, v)
    cache.finalize()
    _rows_equal_alone(cache, [(k[:1], v[:1]), (k[1:2, :, :3], v[1:2, :, :3])])
    # a decode step after it: the padded row's new token lands right after its 3 real ones
    k2, v2 = _kv(2, 1, 4)
    cache.update_and_fetch(k2, v2)
    both = [(mx.concatenate([k[:1], k2[:1]], axis=2), mx.concatenate([v[:1], v2[:1]], axis=2))]
    both.append((mx.concatenate([k[1:2, :, :3], k2[1:2]], axis=2), mx.concatenate([v[1:2, :, :3], v2[1:2]], axis=2)))
    _rows_equal_alone(cache, both)


def test_finalize_on_a_filled_cache_trims_row_tails():
    """The ragged-rollback callers: a filled cache, prepare(right_padding=extra), finalize(): the last
    ``extra[i]`` tokens of row ``i`` leave the row (they become left padding)."""
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    k, v = _kv(2, 6, 5)
    cache = BatchTurboQuantKVCache([0, 0], bits=3.5)
    cache.update_and_fetch(k, v)
    cache.prepare(right_padding=[2, 0])
    cache.finalize()
    _rows_equal_alone(cache, [(k[:1, :, :4], v[:1, :, :4]), (k[1:2], v[1:2])])


def test_contract_edges():
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    cache = BatchTurboQuantKVCache([0], bits=3.5)
    cache.finalize()  # nothing prepared: nothing happens
    assert _meta(cache) == ([0], [0], 0)
    cache.prepare(right_padding=[0])  # no padding: nothing recorded
    k, v = _kv(1, 2, 6)
    cache.update_and_fetch(k, v)
    cache.finalize()
    assert _meta(cache) == ([2], [0], 2)
    with pytest.raises(ValueError, match="empty"):
        cache.prepare(left_padding=[1])
