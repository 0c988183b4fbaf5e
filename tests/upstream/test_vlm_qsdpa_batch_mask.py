"""vlm-qsdpa-batch-mask (V08) beyond its reproduction: the patch reaches the models' call path (each
module's ``scaled_dot_product_attention`` dispatching a BatchQuantizedKVCache), a batched decode equals
per-row float decode, per-head masks, and no mlx-vlm module keeps the unpatched function under a name."""

from __future__ import annotations

import sys

import pytest

import kvpatch
from kvpatch.patches._reproduce import vlm_quantized_attentions
from kvpatch.patches.mlx_vlm.qsdpa_batch_mask import PATCH
from kvpatch.testing import difference, without, worst

pytestmark = pytest.mark.requires_patch(PATCH.id, needed=True)


def _modules():
    return [module for _, module in vlm_quantized_attentions()]


def _batched_vs_rows(module, left_padding, n_kv_heads, n_q_heads=4, dim=64, prompt=6):
    """Decode one token through ``module.scaled_dot_product_attention`` with a BatchQuantizedKVCache and
    its own ``make_mask``; return the max difference to each row attended alone in float32."""
    import mlx.core as mx
    from mlx_vlm.models.cache import BatchQuantizedKVCache

    mx.random.seed(3)
    batch = len(left_padding)
    cache = BatchQuantizedKVCache(left_padding, group_size=64, bits=8)
    keys = mx.random.normal((batch, n_kv_heads, prompt, dim))
    values = mx.random.normal((batch, n_kv_heads, prompt, dim))
    cache.update_and_fetch(keys, values)
    step_k = mx.random.normal((batch, n_kv_heads, 1, dim))
    step_v = mx.random.normal((batch, n_kv_heads, 1, dim))
    queries = mx.random.normal((batch, n_q_heads, 1, dim))
    mask = cache.make_mask(1)
    q_keys, q_values = cache.update_and_fetch(step_k, step_v)
    out = module.scaled_dot_product_attention(queries + 0, q_keys, q_values, cache, scale=dim**-0.5, mask=mask)
    k_all = mx.dequantize(*q_keys, group_size=64, bits=8)
    v_all = mx.dequantize(*q_values, group_size=64, bits=8)
    found = []
    repeats = n_q_heads // n_kv_heads
    for row, pad in enumerate(left_padding):
        k = mx.repeat(k_all[row : row + 1, :, pad:], repeats, axis=1)
        v = mx.repeat(v_all[row : row + 1, :, pad:], repeats, axis=1)
        ref = mx.softmax((queries[row : row + 1] * dim**-0.5) @ k.swapaxes(-1, -2), axis=-1) @ v
        found.append(difference(out[row : row + 1], ref, where=f"{module.__name__}: row {row} batched and alone"))
    return worst(found)


@pytest.mark.parametrize("left_padding,n_kv_heads", [([2, 0], 2), ([0, 3, 1], 2), ([1, 0], 1), ([2, 0], 4)])
def test_model_call_path_matches_per_row_decode(left_padding, n_kv_heads):
    for module in _modules():
        found = _batched_vs_rows(module, left_padding, n_kv_heads)
        assert found.within, found


def test_model_call_path_is_wrong_without_the_patch():
    if not kvpatch.get_engine().status[PATCH.id].installed:
        pytest.skip("patch not installed in this process")
    with without(PATCH.id):
        for module in _modules():
            try:
                found = _batched_vs_rows(module, [2, 0], 2)
            except ValueError:
                continue
            if module.__name__ == "mlx_vlm.models.base" and hasattr(module, "align_attention_mask_to_scores"):
                assert found.within, found  # 0.6.5: this copy is upstream-fixed
            else:
                assert not found.within, f"expected the unpatched silent error, got {found}"


def test_per_head_mask():
    import mlx.core as mx

    mx.random.seed(5)
    batch, n_q_heads, n_kv_heads, q_len, k_len, dim = 2, 4, 2, 2, 5, 64
    queries = mx.random.normal((batch, n_q_heads, q_len, dim))
    keys = mx.random.normal((batch, n_kv_heads, k_len, dim))
    values = mx.random.normal((batch, n_kv_heads, k_len, dim))
    q_keys, q_values = mx.quantize(keys, group_size=64, bits=8), mx.quantize(values, group_size=64, bits=8)
    mask = mx.random.bernoulli(0.7, (batch, n_q_heads, q_len, k_len))
    mask[..., 0] = True  # every query keeps one key
    k_ref = mx.repeat(mx.dequantize(*q_keys, group_size=64, bits=8), 2, axis=1)
    v_ref = mx.repeat(mx.dequantize(*q_values, group_size=64, bits=8), 2, axis=1)
    scores = mx.where(mask, (queries * dim**-0.5) @ k_ref.swapaxes(-1, -2), -mx.inf)
    reference = mx.softmax(scores, axis=-1) @ v_ref
    for module in _modules():
        out = module.quantized_scaled_dot_product_attention(queries + 0, q_keys, q_values, dim**-0.5, mask)
        found = difference(out, reference, where=module.__name__)
        assert found.within, found


def test_no_module_keeps_the_unpatched_function():
    """Every mlx_vlm module's name for a quantized attention function is the module's current (patched) one."""
    current = {id(m.quantized_scaled_dot_product_attention) for m in _modules()}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("mlx_vlm"):
            continue
        for attr, value in list(vars(module).items()):
            if getattr(value, "__name__", None) == "quantized_scaled_dot_product_attention" and callable(value):
                origin = getattr(value, "__module__", "")
                if origin.startswith("mlx_vlm") or origin.startswith("kvpatch.patches"):
                    assert id(value) in current, f"{name}.{attr} is not the patched function"
