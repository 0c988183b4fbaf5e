"""quantized-nbytes where users meet it: the server's LRU prompt cache storing a kv-bits cache.

A tiny llama decodes with ``kv_bits=8`` (its caches become QuantizedKVCache), then the caches go into
``mlx_lm.server.LRUPromptCache`` as the server does after each request; the byte count it keeps must be the
sum of the packed arrays' ``nbytes``.
"""

from __future__ import annotations

import importlib

import pytest

from kvpatch.gate import Action
from kvpatch.patches.mlx_lm.quantized_nbytes import PATCH
from kvpatch.testing import import_targets, natural_decision

mx = pytest.importorskip("mlx.core")


@pytest.fixture(scope="module")
def applied():
    decision = natural_decision(PATCH)
    if decision.action not in (Action.APPLY, Action.NOT_NEEDED):
        pytest.skip(decision.reason)
    import_targets(PATCH)


def test_server_prompt_cache_counts_quantized_bytes(applied):
    from mlx_lm.models import llama
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    server = pytest.importorskip("mlx_lm.server")
    generate = importlib.import_module("mlx_lm.generate")
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-5,
        vocab_size=128,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    prompt = mx.random.randint(0, 128, (12,))
    cache = make_prompt_cache(model)
    answer = [
        int(t)
        for t, _ in generate.generate_step(
            prompt, model, prompt_cache=cache, kv_bits=8, kv_group_size=32, quantized_kv_start=0, max_tokens=4
        )
    ]
    assert all(isinstance(c, QuantizedKVCache) for c in cache)
    expected = sum(x.nbytes for c in cache for x in (*c.keys, *c.values))
    lru = server.LRUPromptCache()
    lru.insert_cache("tiny", prompt.tolist() + answer, cache)
    assert lru.nbytes == expected
