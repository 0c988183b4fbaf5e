"""chunked-trim-front (H1) beyond its reproduction: a tiny random-weight llama4 text model (hidden 64,
4 layers: llama4 needs its 4th, global layer; chunk size 4; no MoE layers) decodes with its own
``make_cache()`` (three ChunkedKVCache layers and one KVCache) with the logits of the uncached forward
over the whole sequence at every step, through several chunk boundaries.
"""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_lm.chunked_trim_front import PATCH
from kvpatch.testing import difference

PROMPT = [7, 3, 22]
STEPS = [11, 30, 40, 5, 9, 13, 2, 60, 17, 33]


pytestmark = pytest.mark.requires_patch(PATCH.id)


@pytest.fixture(scope="module")
def model():
    import mlx.core as mx
    from mlx_lm.models import llama4

    mx.random.seed(0)
    text = {
        "attention_bias": False,
        "attention_chunk_size": 4,
        "head_dim": 16,
        "hidden_act": "silu",  # required by 0.22.5-0.24.x, ignored later
        "hidden_size": 64,
        "interleave_moe_layer_step": 100,  # layer i is MoE when i % step == step - 1: none of 4
        "intermediate_size": 128,
        "intermediate_size_mlp": 128,
        "max_position_embeddings": 1024,
        "model_type": "llama4_text",
        "num_attention_heads": 4,
        "num_experts_per_tok": 1,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 1,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "use_qk_norm": True,
        "vocab_size": 64,
    }
    m = llama4.Model(llama4.ModelArgs(text_config=text, model_type="llama4"))
    mx.eval(m.parameters())
    return m


@pytest.mark.parametrize("prefill", ["prompt", "one-by-one"])
def test_cached_decode_matches_uncached_forward(model, prefill):
    import mlx.core as mx

    cache = model.make_cache()
    if prefill == "prompt":
        model(mx.array([PROMPT]), cache=cache)
    else:
        for tok in PROMPT:
            model(mx.array([[tok]]), cache=cache)
    seq = list(PROMPT)
    for step, tok in enumerate(STEPS):
        seq.append(tok)
        got = model(mx.array([[tok]]), cache=cache)[0, -1]
        want = model(mx.array([seq]))[0, -1]
        found = difference(got, want, where=f"step {step} (position {len(seq) - 1}), from the uncached forward")
        assert found.within, found
