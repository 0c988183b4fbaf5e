"""offset-rebind / offset-rebind-vlm beyond the reproduction: real model files that keep ``cache.offset``
across ``update_and_fetch``, as tiny random-weight models, decode a batch of two with the logits of each
row decoded alone.

* mlx-lm ``gemma3n`` (attention binds the offset, updates the cache, then RoPEs the queries with it):
  wrong on 0.28.x-0.31.x without the patch (max diff 0.98 after prefill, left-padded prompts).
* mlx-lm ``bailing_moe_linear`` and mlx-vlm's copy (0.6.16+): the model binds the first global layer's
  offset once and passes it to every linear-attention layer: decode steps wrong (0.48) without the patch.

Other model files that keep an offset across an update (read, not run here): mlx-vlm 0.7.10 ``limite``
(window mask built from the kept offset), ``longcat_flash_sparse`` (indexer's local window), ``glm5_next``
(indexer offset), ``deepseek_v4``.
"""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_lm.offset_rebind import PATCH as LM_PATCH
from kvpatch.patches.mlx_vlm.offset_rebind import PATCH as VLM_PATCH
from kvpatch.testing import difference, worst

PROMPTS = [[7, 3, 22], [5, 9, 2, 33, 17]]
SAME_LENGTH = [[5, 9, 2, 33, 17], [1, 2, 3, 4, 5]]
STEPS = [11, 30, 41]


def _logits(out):
    return getattr(out, "logits", out)


def _compare(model, batch_caches, prompts, single_caches):
    """The largest difference (the worst, against its rounding) of batched and alone logits over the rows and steps
    (prefill's last position, then each decode step)."""
    import mlx.core as mx

    width = max(map(len, prompts))
    tokens = mx.array([[0] * (width - len(p)) + p for p in prompts])
    batched = [_logits(model(tokens, cache=batch_caches))[:, -1]]
    for t in STEPS:
        batched.append(_logits(model(mx.array([[t]] * len(prompts)), cache=batch_caches))[:, -1])
    found = []
    for i, p in enumerate(prompts):
        caches = single_caches()
        alone = [_logits(model(mx.array([p]), cache=caches))[0, -1]]
        for t in STEPS:
            alone.append(_logits(model(mx.array([[t]]), cache=caches))[0, -1])
        found += [
            difference(b[i], a, where=f"row {i}, step {s}") for s, (b, a) in enumerate(zip(batched, alone, strict=True))
        ]
    return worst(found)


def _lm_batch_caches(model, prompts):
    from mlx_lm.models import cache as C

    width = max(map(len, prompts))
    pad = [width - len(p) for p in prompts]
    out = []
    for c in model.make_cache():
        if isinstance(c, C.RotatingKVCache):
            out.append(C.BatchRotatingKVCache(c.max_size, pad))
        elif isinstance(c, C.KVCache):
            out.append(C.BatchKVCache(pad))
        else:
            out.append(C.ArraysCache(size=len(c.cache), left_padding=pad))
    return out


@pytest.mark.requires_patch(LM_PATCH.id)
def test_gemma3n_batched_equals_rows_alone():
    import mlx.core as mx

    gemma3n = pytest.importorskip("mlx_lm.models.gemma3n")
    from mlx_lm.models import cache as C

    if not hasattr(C, "BatchRotatingKVCache"):
        pytest.skip("no BatchRotatingKVCache (mlx-lm 0.28.0): gemma3n's sliding layers cannot batch")
    mx.random.seed(0)
    text = dict(
        model_type="gemma3n_text", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, head_dim=16, rms_norm_eps=1e-6, vocab_size=64, num_key_value_heads=2,
        num_kv_shared_layers=0, vocab_size_per_layer_input=64, sliding_window=16, max_position_embeddings=256,
        rope_local_base_freq=10000.0, rope_theta=1000000.0, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention"], activation_sparsity_pattern=[0.0, 0.0],
        hidden_size_per_layer_input=8, altup_num_inputs=2, altup_coef_clip=120.0, altup_correct_scale=True,
        altup_active_idx=0, laurel_rank=4,
    )  # fmt: skip
    model = gemma3n.Model(gemma3n.ModelArgs(model_type="gemma3n", text_config=text))
    mx.eval(model.parameters())
    found = _compare(model, _lm_batch_caches(model, PROMPTS), PROMPTS, model.make_cache)
    assert found.within, f"batched gemma3n differs from each row alone: {found}"


def _bailing_args(cls):
    return cls(
        model_type="bailing_moe_linear", hidden_size=64, intermediate_size=128, max_position_embeddings=256,
        moe_intermediate_size=32, num_experts=4, num_shared_experts=1, norm_topk_prob=True, num_attention_heads=4,
        num_experts_per_tok=2, num_hidden_layers=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
        vocab_size=64, first_k_dense_replace=4, layer_group_size=2, group_norm_size=1,
    )  # fmt: skip


@pytest.mark.requires_patch(LM_PATCH.id)
def test_bailing_moe_linear_batched_equals_rows_alone():
    import mlx.core as mx

    bailing = pytest.importorskip("mlx_lm.models.bailing_moe_linear")
    mx.random.seed(0)
    model = bailing.Model(_bailing_args(bailing.ModelArgs))
    mx.eval(model.parameters())
    found = _compare(model, _lm_batch_caches(model, SAME_LENGTH), SAME_LENGTH, model.make_cache)
    assert found.within, f"batched bailing_moe_linear differs from each row alone: {found}"


@pytest.mark.requires_patch(VLM_PATCH.id)
def test_vlm_bailing_moe_linear_batched_equals_rows_alone():
    import mlx.core as mx

    language = pytest.importorskip("mlx_vlm.models.bailing_moe_linear.language")
    from mlx_vlm.models import cache as C
    from mlx_vlm.models.bailing_moe_linear.config import ModelConfig

    if not C.BatchKVCache.__module__.startswith("mlx_vlm."):
        pytest.skip("mlx-vlm uses mlx-lm's BatchKVCache here")
    mx.random.seed(0)
    model = language.LanguageModel(_bailing_args(ModelConfig))
    mx.eval(model.parameters())
    batch = [
        C.BatchKVCache([0, 0]) if isinstance(c, C.KVCache) else C.ArraysCache(size=1, left_padding=[0, 0])
        for c in model.make_cache()
    ]
    found = _compare(model, batch, SAME_LENGTH, model.make_cache)
    assert found.within, f"batched bailing_moe_linear (mlx-vlm) differs from each row alone: {found}"
