"""tq-value-codec (V07) beyond its reproduction:

* a left-padded batch with different key and value head dims (96/64) decodes, over a prefill and three
  steps, exactly like each row decoded in a batch cache of its own;
* with equal head dims and integer bits (the common case) the patch changes nothing: the packed state
  and its dequantization are bit-identical with and without it.
"""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_vlm.tq_value_codec import PATCH
from kvpatch.testing import difference, without

H, DK, DV = 2, 96, 64


pytestmark = pytest.mark.requires_patch(PATCH.id)


def _steps(dk, dv):
    import mlx.core as mx

    mx.random.seed(0)
    return [
        (mx.random.normal((2, H, n, dk)), mx.random.normal((2, H, n, dv)), mx.random.normal((2, H, 1, dk)))
        for n in (5, 1, 1, 1)
    ]


def _run(cache, steps, rows):
    """Attention output of the last query position per step, for the given batch rows."""
    import mlx.core as mx

    outs = []
    for keys, values, q in steps:
        k, v = cache.dequantize(*cache.update_and_fetch(keys[rows], values[rows]))
        mask = mx.arange(k.shape[-2])[None, None, None, :] >= cache.left_padding[:, None, None, None]
        outs.append(mx.fast.scaled_dot_product_attention(q[rows], k, v, scale=DK**-0.5, mask=mask))
    return mx.concatenate(outs, axis=2)


@pytest.mark.parametrize("bits", [4, 3])
def test_batched_decode_equals_per_row_decode(bits):
    import mlx.core as mx
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    steps = _steps(DK, DV)
    left_padding = [2, 0]
    batched = _run(BatchTurboQuantKVCache(left_padding, bits=bits), steps, mx.array([0, 1]))
    assert batched.shape[-1] == DV
    for row, lp in enumerate(left_padding):
        alone = _run(BatchTurboQuantKVCache([lp], bits=bits), steps, mx.array([row]))
        found = difference(batched[row], alone[0], where=f"row {row} against itself alone")
        assert found.within, found


def test_equal_head_dims_unchanged():
    import mlx.core as mx
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    steps = _steps(64, 64)

    def run():
        cache = BatchTurboQuantKVCache([1, 0], bits=4)
        out = _run(cache, steps, mx.array([0, 1]))
        return out, cache.dequantize()

    patched, (pk, pv) = run()
    with without(PATCH.id):
        unpatched, (uk, uv) = run()
    assert mx.array_equal(patched, unpatched).item()
    assert mx.array_equal(pk, uk).item() and mx.array_equal(pv, uv).item()
