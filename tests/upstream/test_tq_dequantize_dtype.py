"""tq-dequantize-dtype (V30) beyond its reproduction:

* attention through mlx-vlm's own dispatch (``models.base.scaled_dot_product_attention``) on a bf16
  TurboQuant cache is bit-identical with and without the patch (the dense fallback casts to the query
  dtype anyway);
* the bf16 K/V the patch hands out stay within bf16 rounding of the codec's float32 reconstruction, and
  attention over them is within bf16's rounding of attention over the float32 reconstruction;
* the APC's dense paths (``apc.layer_kv_for_apc`` and the dense row clones of
  ``apc.snapshot_prompt_cache_row``, 0.6.5+) give back bf16 for a bf16 batch cache.
"""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_vlm.tq_dequantize_dtype import PATCH
from kvpatch.testing import difference, exact, without

pytestmark = pytest.mark.requires_patch(PATCH.id)


def _inputs(rows, tokens, dtype_name="bfloat16"):
    import mlx.core as mx

    mx.random.seed(0)
    dtype = getattr(mx, dtype_name)
    return [mx.random.normal((rows, 2, n, 32)).astype(dtype) for n in tokens]


def _caches():
    """(name, cache fed bf16 prompt + one decode step, left padding or None)."""
    import mlx.core as mx
    from mlx_vlm import turboquant

    out = []
    k0, v0, k1, v1 = _inputs(1, (5, 5, 1, 1))
    single = turboquant.TurboQuantKVCache(bits=4)
    single.update_and_fetch(k0, v0)
    out.append(("TurboQuantKVCache", single, single.update_and_fetch(k1, v1), None))
    if hasattr(turboquant, "BatchTurboQuantKVCache"):
        k0, v0, k1, v1 = _inputs(2, (5, 5, 1, 1))
        batch = turboquant.BatchTurboQuantKVCache([2, 0], bits=4)
        batch.update_and_fetch(k0, v0)
        out.append(("BatchTurboQuantKVCache", batch, batch.update_and_fetch(k1, v1), mx.array([2, 0])))
    return out


def _mask(left_padding, width):
    import mlx.core as mx

    if left_padding is None:
        return None
    return mx.arange(width)[None, None, None, :] >= left_padding[:, None, None, None]


def test_attention_through_mlx_vlm_dispatch_is_unchanged():
    import mlx.core as mx
    from mlx_vlm.models import base

    for name, cache, (ks, vs), lp in _caches():
        q = mx.random.normal((lp.shape[0] if lp is not None else 1, 2, 1, 32)).astype(mx.bfloat16)
        mask = _mask(lp, cache.dequantize(ks, vs)[0].shape[-2])
        patched = base.scaled_dot_product_attention(q, ks, vs, cache, scale=32**-0.5, mask=mask)
        with without(PATCH.id):
            unpatched = base.scaled_dot_product_attention(q, ks, vs, cache, scale=32**-0.5, mask=mask)
        assert patched.dtype == unpatched.dtype == mx.bfloat16
        assert exact(patched, unpatched), name


def test_numbers_within_bf16_rounding_of_the_float32_reconstruction():
    import mlx.core as mx

    for name, cache, (ks, vs), lp in _caches():
        k, v = cache.dequantize(ks, vs)
        with without(PATCH.id):
            k32, v32 = cache.dequantize(ks, vs)
        assert (k.dtype, v.dtype, k32.dtype) == (mx.bfloat16, mx.bfloat16, mx.float32), name
        for low, full in ((k, k32), (v, v32)):
            found = difference(low, full, mx.bfloat16, where=f"{name}: bf16 K/V against the float32 reconstruction")
            assert found.within, found
        q = mx.random.normal((k.shape[0], 2, 1, 32))
        mask = _mask(lp, k.shape[-2])
        att = mx.fast.scaled_dot_product_attention(
            q, k.astype(mx.float32), v.astype(mx.float32), scale=32**-0.5, mask=mask
        )
        ref = mx.fast.scaled_dot_product_attention(q, k32, v32, scale=32**-0.5, mask=mask)
        found = difference(att, ref, mx.bfloat16, where=f"{name}: attention over bf16 K/V against the float32 one")
        assert found.within, found


def test_apc_dense_paths_keep_bf16():
    import mlx.core as mx

    apc = pytest.importorskip("mlx_vlm.apc")
    if not hasattr(apc, "layer_kv_for_apc"):
        pytest.skip("this mlx-vlm has no layer_kv_for_apc (APC harvest of TurboQuant caches starts in 0.6.5)")
    batch = next(c for name, c, _, _ in _caches() if name == "BatchTurboQuantKVCache")
    for row in (0, 1):
        k, v = apc.layer_kv_for_apc(batch, batch_idx=row)
        assert (k.dtype, v.dtype) == (mx.bfloat16, mx.bfloat16)
        assert k.shape[-2] == batch._idx - batch.left_padding[row].item()
        (entry,) = apc.snapshot_prompt_cache_row([batch], row)
        if isinstance(entry.keys, mx.array):  # a dense clone (0.6.5–0.6.17); 0.7.x keeps the packed state
            assert (entry.keys.dtype, entry.values.dtype) == (mx.bfloat16, mx.bfloat16)
            assert mx.array_equal(entry.keys, k).item()
