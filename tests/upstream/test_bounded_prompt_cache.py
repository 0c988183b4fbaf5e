"""``kvpatch.bounded_prompt_cache``: per-call bounding as mlx-lm's own batch path does it (issue 29 item 2).

Where mlx-lm has ``BatchGenerator._make_new_cache`` (0.31.2, 0.31.3) the helper's topology (types,
``max_size``, ``keep``) equals it for a tiny llama (``make_cache`` of plain ``KVCache``\\ s), a hybrid LFM2
(``ArraysCache`` + ``KVCache``) and cohere2 (sliding ``RotatingKVCache`` + global ``KVCache``); for a
``CacheList`` model (falcon_h1) the helper also bounds the nested ``KVCache`` that ``_make_new_cache`` leaves
unbounded. On every release the bounded caches generate, single-stream and batched, and stay bounded.
The process-wide opt-in ``max-kv-size-ignored`` is not needed and not touched (``make_prompt_cache`` keeps
upstream's documented behaviour). Runs in the ``lm-*`` buckets (once per mlx-lm release).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
from typing import Any

import pytest

import kvpatch
from kvpatch.testing import tiny_llama, without

N = 16

pytestmark = pytest.mark.skipif(
    not os.environ.get("KVPATCH_BUCKET", "lm-").startswith("lm-"), reason="runs in the lm-* buckets"
)


def _lfm2() -> Any:
    import mlx.core as mx
    from mlx_lm.models import lfm2

    mx.random.seed(0)
    args = lfm2.ModelArgs.from_dict(
        dict(
            model_type="lfm2", vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=256, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
            block_dim=32, block_ff_dim=64, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=False, rope_theta=10000.0, layer_types=["conv", "full_attention", "conv"],
            full_attn_idxs=[1],  # what releases before layer_types take (from_dict drops what a release lacks)
        )
    )  # fmt: skip
    model = lfm2.Model(args)
    mx.eval(model.parameters())
    return model


def _cohere2() -> Any:
    from kvpatch.patches.mlx_lm.max_kv_size_ignored import _tiny_cohere2

    return _tiny_cohere2(window=8)


def _falcon_h1() -> Any:
    import mlx.core as mx
    from mlx_lm.models import falcon_h1

    mx.random.seed(0)
    args = falcon_h1.ModelArgs(
        hidden_size=32, head_dim=8, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
        intermediate_size=64, vocab_size=64, mamba_d_conv=4, mamba_d_head=8, mamba_d_ssm=32, mamba_d_state=8,
        mamba_n_groups=1, mamba_n_heads=4, mamba_chunk_size=8,
    )  # fmt: skip
    model = falcon_h1.Model(args)
    mx.eval(model.parameters())
    return model


MODELS = {"llama": lambda: tiny_llama(vocab=64), "lfm2": _lfm2, "cohere2": _cohere2}


def _model(name: str) -> Any:
    if importlib.util.find_spec(f"mlx_lm.models.{name}") is None:
        pytest.skip(f"mlx-lm {importlib.metadata.version('mlx-lm')} has no {name}")
    return {**MODELS, "falcon_h1": _falcon_h1}[name]()


def topology(caches: Any) -> list[Any]:
    out = []
    for c in caches:
        children = getattr(c, "caches", None)
        if children is not None:
            out.append((type(c).__name__, topology(children)))
        else:
            out.append((type(c).__name__, getattr(c, "max_size", None), getattr(c, "keep", None)))
    return out


def _upstream_batch_cache(model: Any) -> Any:
    generate = importlib.import_module("mlx_lm.generate")
    make = getattr(getattr(generate, "BatchGenerator", None), "_make_new_cache", None)
    if make is None:
        pytest.skip("this mlx-lm has no BatchGenerator._make_new_cache (0.31.2-0.31.3 only) to compare with")
    return generate.BatchGenerator(model, max_kv_size=N)._make_new_cache()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_topology_equals_upstreams_batch_path(name):
    model = _model(name)
    ours = topology(kvpatch.bounded_prompt_cache(model, N))
    assert ours == topology(_upstream_batch_cache(model))
    assert ("KVCache", None, None) not in ours, ours  # no full-attention layer left unbounded
    assert ("RotatingKVCache", N, 0) in ours, ours


def test_cachelist_children_are_bounded_where_upstream_leaves_them():
    model = _model("falcon_h1")
    ours = topology(kvpatch.bounded_prompt_cache(model, N))
    upstream = topology(_upstream_batch_cache(model))
    assert upstream[0] == ("CacheList", [("ArraysCache", None, None), ("KVCache", None, None)]), upstream
    assert ours[0] == ("CacheList", [("ArraysCache", None, None), ("RotatingKVCache", N, 0)]), ours


def test_model_own_layout_and_options():
    cache_module = importlib.import_module("mlx_lm.models.cache")

    def make_prompt_cache(*args: Any) -> Any:  # looked up at call time (the opt-in replaces it)
        return cache_module.make_prompt_cache(*args)

    model = _model("cohere2")
    assert topology(kvpatch.bounded_prompt_cache(model, None)) == topology(make_prompt_cache(model))
    assert topology(kvpatch.bounded_prompt_cache(model, N, keep=4))[1] == ("RotatingKVCache", N, 4)
    # per call: the same with the process-wide opt-in (this session enables it) in or out, and without it
    # upstream's documented behaviour stays
    bounded = topology(kvpatch.bounded_prompt_cache(model, N))
    with without("max-kv-size-ignored"):
        assert topology(kvpatch.bounded_prompt_cache(model, N)) == bounded
        assert topology(make_prompt_cache(model, N))[1] == ("KVCache", None, None)
    with pytest.raises(ValueError):
        kvpatch.bounded_prompt_cache(model, 0)
    with pytest.raises(ValueError):
        kvpatch.bounded_prompt_cache(model, N, keep=N)
    with pytest.raises(TypeError):
        kvpatch.bounded_prompt_cache(model, 16.0)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generation_stays_bounded(name):
    import mlx.core as mx

    generate = importlib.import_module("mlx_lm.generate")
    step = getattr(generate, "generate_step", None) or importlib.import_module("mlx_lm.utils").generate_step
    model = _model(name)
    cache = kvpatch.bounded_prompt_cache(model, N)
    prompt = mx.array([(7 * i) % 60 + 1 for i in range(2 * N)])
    tokens = [int(t) for t, _ in step(prompt, model, prompt_cache=cache, max_tokens=N)]
    assert len(tokens) == N
    for c in cache:
        if type(c).__name__ == "RotatingKVCache" and c.max_size == N:
            assert c.keys.shape[2] <= N < 2 * N <= c.offset, (c.keys.shape, c.offset)  # bounded, positions past N


@pytest.mark.parametrize("name", sorted(MODELS))
def test_batched_generation_with_the_servers_caches(name):
    """What a server does: build each request's cache and hand it to upstream's BatchGenerator."""
    import inspect

    generate = importlib.import_module("mlx_lm.generate")
    gen_class = getattr(generate, "BatchGenerator", None)
    if gen_class is None or "caches" not in inspect.signature(gen_class.insert).parameters:
        pytest.skip("this mlx-lm's BatchGenerator takes no caches")
    if name == "lfm2" and not hasattr(importlib.import_module("mlx_lm.models.cache").ArraysCache, "extract"):
        pytest.skip("this mlx-lm's BatchGenerator batches no hybrid model (ArraysCache.extract: 0.30.4+)")
    model = _model(name)
    gen = gen_class(model, max_tokens=N, prefill_step_size=8)
    prompts = [[(5 * i + j) % 60 + 1 for i in range(2 * N)] for j in range(2)]
    uids = gen.insert(prompts, caches=[kvpatch.bounded_prompt_cache(model, N) for _ in prompts])
    counts = dict.fromkeys(uids, 0)
    finished: set[int] = set()
    for _ in range(4 * N):
        responses = gen.next()
        if isinstance(responses, tuple):
            responses = responses[1]
        for r in responses:
            counts[r.uid] += 1
            if r.finish_reason is not None:
                finished.add(r.uid)
        if len(finished) == len(uids):
            break
    assert finished == set(uids) and all(n == N for n in counts.values()), counts
