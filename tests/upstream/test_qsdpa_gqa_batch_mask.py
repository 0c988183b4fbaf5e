"""qsdpa-gqa-batch-mask (A3) on the paths models take.

* mlx-lm: ``mlx_lm.models.base.scaled_dot_product_attention`` (what every model calls) dispatching a
  2-row QuantizedKVCache with a per-row boolean left-padding mask (B, 1, 1, S) equals each row
  attended alone in float32 (4 query / 1 KV head and 8 query / 2 KV heads).
* mlx-vlm 0.5.0-0.6.3, whose ``BatchQuantizedKVCache`` runs through mlx-lm's quantized attention: a
  tiny random-weight GQA language model (pixtral's mistral, 4 query / 2 KV heads, batch 2 == KV heads:
  the silently wrong case) decodes a left-padded batch with the logits of each row decoded alone.
"""

from __future__ import annotations

import pytest

from kvpatch.gate import Action
from kvpatch.patches.mlx_lm.mask_fill import PATCH as MASK_FILL
from kvpatch.patches.mlx_lm.qsdpa_gqa_batch_mask import PATCH
from kvpatch.testing import (
    difference,
    natural_decision,
    skip_unless_in_place,
    tiny_pixtral_language_model,
)

PROMPTS = [[7, 3, 22, 41, 8], [9, 13]]
STEPS = [[11, 12], [30, 31], [40, 41]]


pytestmark = pytest.mark.requires_patch(PATCH.id)


@pytest.mark.parametrize("heads", [(4, 1), (8, 2)], ids=["4q1kv", "8q2kv"])
def test_model_entry_point(heads):
    import mlx.core as mx
    from mlx_lm.models import base
    from mlx_lm.models.cache import QuantizedKVCache

    if natural_decision(MASK_FILL).action is Action.OUT_OF_RANGE:
        pytest.skip("below mask-fill's range boolean masks have A1's bug, which no patch covers there")
    n_q, n_kv = heads
    mx.random.seed(1)
    left_padding = [3, 0]
    cache = QuantizedKVCache(group_size=64, bits=8)
    cache.update_and_fetch(mx.random.normal((2, n_kv, 6, 64)), mx.random.normal((2, n_kv, 6, 64)))
    q = mx.random.normal((2, n_q, 1, 64))
    q_keys, q_values = cache.update_and_fetch(mx.random.normal((2, n_kv, 1, 64)), mx.random.normal((2, n_kv, 1, 64)))
    mask = mx.arange(7) >= mx.array(left_padding)[:, None, None, None]  # (B, 1, 1, S): what batch caches build
    out = base.scaled_dot_product_attention(q + 0, q_keys, q_values, cache=cache, scale=0.125, mask=mask)
    keys = mx.repeat(mx.dequantize(*q_keys, group_size=64, bits=8), n_q // n_kv, axis=1)
    values = mx.repeat(mx.dequantize(*q_values, group_size=64, bits=8), n_q // n_kv, axis=1)
    for row, pad in enumerate(left_padding):
        k, v = keys[row : row + 1, :, pad:], values[row : row + 1, :, pad:]
        ref = mx.softmax((q[row : row + 1] * 0.125) @ k.swapaxes(-1, -2), axis=-1) @ v
        found = difference(out[row : row + 1], ref, where=f"row {row}")
        assert found.within, found


def _vlm_uses_mlx_lm_attention() -> bool:
    try:
        import mlx_vlm.models.base as vbase
        from mlx_vlm.models.cache import BatchQuantizedKVCache  # noqa: F401
    except ImportError:
        return False
    return not hasattr(vbase, "quantized_scaled_dot_product_attention")  # 0.6.4+ carry their own copy


@pytest.fixture(scope="module")
def vlm_model():
    if not _vlm_uses_mlx_lm_attention():
        pytest.skip("needs mlx-vlm 0.5.0-0.6.3 (BatchQuantizedKVCache over mlx-lm's quantized attention)")
    skip_unless_in_place("left-padding-mask", "V01 (left padding not masked)")
    return tiny_pixtral_language_model(head_dim=64, heads=4, kv_heads=2)


def _vlm_decode(model, prompts, steps):
    import mlx.core as mx
    from mlx_vlm.models.cache import BatchQuantizedKVCache

    width = max(map(len, prompts))
    padding = [width - len(p) for p in prompts]
    caches = [BatchQuantizedKVCache(padding, group_size=64, bits=8) for _ in model.layers]
    model(mx.array([[0] * pad + p for pad, p in zip(padding, prompts, strict=True)]), cache=caches)
    return [model(mx.array(s)[:, None], cache=caches).logits[:, -1] for s in steps]


def test_vlm_batch_quantized_decode_matches_rows_alone(vlm_model):
    batched = _vlm_decode(vlm_model, PROMPTS, STEPS)
    for row, prompt in enumerate(PROMPTS):
        alone = _vlm_decode(vlm_model, [prompt], [[s[row]] for s in STEPS])
        for step, (b, a) in enumerate(zip(batched, alone, strict=True)):
            found = difference(b[row], a[0], where=f"row {row}, step {step}, from the row decoded alone")
            assert found.within, found
