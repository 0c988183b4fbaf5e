"""arrays-mask-lengths beyond its reproduction, on a tiny random Qwen3-Next (one Gated DeltaNet layer, one
attention layer; the linear layer gates its state update with the cache's make_mask):

* a right-padded prefill on an ArraysCache that also has left padding (what 0.31.3's BatchGenerator sets
  up for every mixed-length batch): the shorter row's recurrent state equals the row prefilled alone;
* mlx-lm's own BatchGenerator: every row's log-probabilities equal the prompt generated alone.
"""

from __future__ import annotations

import importlib.metadata

import pytest
from packaging.version import Version
from support import arrays_state_difference

import kvpatch
from kvpatch.patches.mlx_lm.arrays_mask_lengths import PATCH
from kvpatch.testing import difference, without, worst

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17]]


pytestmark = pytest.mark.requires_patch(PATCH.id)


def _patched() -> bool:
    return bool(kvpatch.get_engine().status[PATCH.id].installed)


def _tiny_qwen3_next():
    import mlx.core as mx
    from mlx_lm.models import qwen3_next

    mx.random.seed(0)
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=0,
        num_experts_per_tok=1,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=128,
        mlp_only_layers=[0, 1],
        moe_intermediate_size=64,
        rms_norm_eps=1e-5,
        vocab_size=97,
        num_key_value_heads=2,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=512,
        head_dim=16,
        full_attention_interval=2,
    )
    model = qwen3_next.Model(args)
    mx.eval(model.parameters())
    return model


def _state_difference(model):
    """Row 1 of a right-padded batch ([10, 11] + 6 pads, left_padding 0) against [10, 11] alone."""
    from mlx_lm.models.cache import ArraysCache

    batch = [[1, 2, 3, 4, 5, 6, 7, 8], [10, 11, 0, 0, 0, 0, 0, 0]]
    return arrays_state_difference(model, ArraysCache, batch, [0, 0], [8, 2], 1, [10, 11])


def test_recurrent_state_ignores_right_padding():
    model = _tiny_qwen3_next()
    found = _state_difference(model)
    assert found.within, found
    if _patched():
        with without(PATCH.id):
            found = _state_difference(model)
            assert not found.within, found  # measured 0.038 on 0.30.4-0.31.3


def _logprob_differences(model):
    """Per prompt, the largest difference of batched and alone log-probabilities over the generated steps."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    def generate(prompts, n=6):
        gen = BatchGenerator(model, max_tokens=n)
        uids = gen.insert(prompts, max_tokens=[n] * len(prompts))
        step = getattr(gen, "next_generated", None) or gen.next
        out = {u: [] for u in uids}
        while responses := step():
            for r in responses:
                out[r.uid].append(r.logprobs)
        return [mx.stack(out[u]) for u in uids]

    batched = generate(PROMPTS)
    alone = [generate([p])[0] for p in PROMPTS]
    return [difference(b, a, shift_free=True) for b, a in zip(batched, alone, strict=True)]


def test_batch_generator_rows_match_alone():
    model = _tiny_qwen3_next()
    found = worst(_logprob_differences(model))
    assert found.within, found
    # Only 0.31.3's BatchGenerator gives fresh ArraysCaches left_padding=zeros before its right-padded
    # prompt step (0.30.4-0.31.2 leave left_padding None there, so their batches match either way).
    if _patched() and Version(importlib.metadata.version("mlx-lm")) >= Version("0.31.3"):
        with without(PATCH.id):
            found = worst(_logprob_differences(model))
            assert not found.within, found  # measured 0.024 on 0.31.3 (CPU)
