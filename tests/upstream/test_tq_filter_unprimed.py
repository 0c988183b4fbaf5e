"""tq-filter-unprimed (V13) beyond its reproduction:

* a batch filtered before its first update then prefills and decodes every kept row exactly like that
  row in a batch cache of its own (with its own left padding);
* filtering a primed cache (the common case) is unchanged by the patch;
* from 0.7.0 the fused-attention guard follows the corrected padding (a single kept row that still has
  padding is not eligible).
"""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_vlm.tq_filter_unprimed import PATCH
from kvpatch.testing import difference, without

H, D = 2, 32


pytestmark = pytest.mark.requires_patch(PATCH.id)


def _steps(rows):
    import mlx.core as mx

    mx.random.seed(0)
    return [
        (mx.random.normal((rows, H, n, D)), mx.random.normal((rows, H, n, D)), mx.random.normal((rows, H, 1, D)))
        for n in (6, 1, 1)
    ]


def _run(cache, steps, rows):
    import mlx.core as mx

    outs = []
    for keys, values, q in steps:
        k, v = cache.dequantize(*cache.update_and_fetch(keys[rows], values[rows]))
        mask = mx.arange(k.shape[-2])[None, None, None, :] >= cache.left_padding[:, None, None, None]
        outs.append(mx.fast.scaled_dot_product_attention(q[rows], k, v, scale=D**-0.5, mask=mask))
    return mx.concatenate(outs, axis=2)


def test_unprimed_filter_then_batched_decode_equals_per_row():
    import mlx.core as mx
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    left_padding, keep = [3, 0, 2, 4], [0, 2, 3]
    steps = _steps(len(keep))
    cache = BatchTurboQuantKVCache(left_padding, bits=4)
    cache.filter(mx.array(keep))
    assert cache._idx == 0 and cache.left_padding.tolist() == [left_padding[i] for i in keep]
    batched = _run(cache, steps, mx.arange(len(keep)))
    for row, original in enumerate(keep):
        alone = _run(BatchTurboQuantKVCache([left_padding[original]], bits=4), steps, mx.array([row]))
        found = difference(batched[row], alone[0], where=f"kept row {original} against itself alone")
        assert found.within, found


def test_primed_filter_unchanged():
    import mlx.core as mx
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    steps = _steps(3)

    def run():
        cache = BatchTurboQuantKVCache([2, 0, 1], bits=4)
        _run(cache, steps[:1], mx.arange(3))
        cache.filter(mx.array([0, 2]))
        out = _run(cache, steps[1:], mx.array([0, 2]))
        return cache._idx, cache.left_padding.tolist(), cache.offset.tolist(), out

    *patched_state, patched = run()
    with without(PATCH.id):
        *unpatched_state, unpatched = run()
    assert patched_state == unpatched_state
    assert mx.array_equal(patched, unpatched).item()


def test_fused_attention_guard_follows_the_padding():
    import mlx.core as mx
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    if not hasattr(BatchTurboQuantKVCache, "_refresh_fused_attention_eligibility"):
        pytest.skip("this mlx-vlm has no fused-attention guard on the batch cache (0.7.0+)")
    cache = BatchTurboQuantKVCache([2, 0], bits=4)
    cache.filter(mx.array([0]))
    assert cache.left_padding.tolist() == [2]
    assert not cache.fused_attention_eligible
