"""offset-detach (B1) beyond its reproduction: flat graph over thousands of NoPE-style steps, bit-identical
cache contents, a NoPE layer inside a real model, and identical BatchGenerator tokens patched vs unpatched.

Graph size is read with ``mx.export_to_dot`` (edges of the unevaluated graph behind the offset; an
evaluated array has none): deterministic, unlike RSS or timing.
"""

from __future__ import annotations

import pytest
from _edges import growth_period, max_edges

import kvpatch
from kvpatch.gate import Action
from kvpatch.patches._lazy import CHECKPOINTS, EVERY, ClassValue
from kvpatch.patches.mlx_lm.offset_detach import PATCH, graph_edges
from kvpatch.testing import import_targets, natural_decision, without

STEPS = 3000


@pytest.fixture(scope="module", autouse=True)
def _in_range():
    decision = natural_decision(PATCH)
    if decision.action in (Action.NOT_INSTALLED, Action.OUT_OF_RANGE, Action.NOT_NEEDED):
        pytest.skip(f"{PATCH.id}: {decision.reason}")
    import_targets(PATCH)


def _patched() -> bool:
    return bool(kvpatch.get_engine().status[PATCH.id].installed)


def _bound() -> int:
    """The most edges the offset's pending graph may reach: ties at every buffer growth (0.28.1+: ``step`` is
    served by the growth tie), or every EVERY steps (0.28.0's wrapper), or (unpatched) EVERY's bound anyway."""
    from mlx_lm.models.cache import BatchKVCache

    return max_edges(growth_period(BatchKVCache) or EVERY)


def _nope_steps(steps: int, checkpoints: tuple[int, ...], dtype=None):
    """Decode ``steps`` tokens into a left-padded BatchKVCache, evaluating only keys/values each step."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    dtype = dtype or mx.float32
    mx.random.seed(1)
    cache = BatchKVCache([3, 1, 0])
    prompt = mx.random.normal((3, 2, 5, 16)).astype(dtype)
    k, v = cache.update_and_fetch(prompt, -prompt)
    mx.eval(k, v)
    tokens = mx.random.normal((steps, 3, 2, 1, 16)).astype(dtype)
    mx.eval(tokens)
    edges = {}
    for i in range(steps):
        k, v = cache.update_and_fetch(tokens[i], tokens[i] * 2)
        mx.eval(k, v)
        if i + 1 in checkpoints:
            edges[i + 1] = graph_edges(cache.offset)
    return cache, k, v, edges


def test_offset_graph_flat_over_thousands_of_steps():
    # checkpoints 1280 steps apart (a multiple of both tie periods, 256 and 10) see the same pending chain; every
    # step of the last 260 (a buffer growth, at step 2812, included) stays within the bound
    first, second = CHECKPOINTS
    third = second + (second - first)
    checkpoints = (first, second, *range(STEPS - 260, STEPS + 1))
    cache, _, _, edges = _nope_steps(STEPS, checkpoints)
    assert third in edges
    assert cache.offset.tolist() == [5 - 3 + STEPS, 5 - 1 + STEPS, 5 + STEPS]
    assert max(edges.values()) <= _bound(), f"offset graph edges at {checkpoints}: {edges}"
    assert edges[first] == edges[second] == edges[third], edges
    if _patched():
        with without(PATCH.id):
            _, _, _, grown = _nope_steps(STEPS, checkpoints)
        # unpatched: one Add + one Broadcast (5 edges) per step, forever
        assert grown[third] - grown[first] >= 4 * (third - first), grown


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_keys_values_offset_unchanged(dtype_name):
    import mlx.core as mx

    if not _patched():
        pytest.skip(f"{PATCH.id} is not installed in this process")
    dtype = getattr(mx, dtype_name)
    cache, k, v, _ = _nope_steps(300, (), dtype)
    with without(PATCH.id):
        ref, rk, rv, _ = _nope_steps(300, (), dtype)
    assert k.dtype == rk.dtype == dtype
    assert mx.array_equal(k, rk).item() and mx.array_equal(v, rv).item()
    assert mx.array_equal(cache.offset, ref.offset).item()
    assert mx.array_equal(cache.left_padding, ref.left_padding).item()
    assert cache._idx == ref._idx


def _tiny(model_type: str):
    import importlib

    import mlx.core as mx

    arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(0)
    config = dict(
        model_type=model_type,
        hidden_size=64,
        num_hidden_layers=2 if model_type == "llama" else 4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=97,
        tie_word_embeddings=False,
    )
    model = arch.Model(arch.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def test_nope_layer_in_a_model_stays_bounded():
    """SmolLM3 (every 4th layer NoPE): a left-padded batch decode loop evaluating only the logits."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    model = _tiny("smollm3")
    assert model.args.no_rope_layers == [1, 1, 1, 0]

    def run():
        cache = [BatchKVCache([2, 0]) for _ in model.layers]
        prompt = mx.array([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
        y = mx.argmax(model(prompt, cache=cache)[:, -1], axis=-1)
        mx.eval(y)
        out, edges = [], {}
        for i in range(CHECKPOINTS[1]):
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
            mx.eval(y)
            out.append(y.tolist())
            if i + 1 in CHECKPOINTS:
                edges[i + 1] = [graph_edges(c.offset) for c in cache]
        return out, edges

    first, last = CHECKPOINTS
    tokens, edges = run()
    # RoPE layers read their offset every step; the NoPE layer (index 3) must not accumulate either
    assert edges[first][3] == edges[last][3] <= _bound(), edges
    if _patched():
        with without(PATCH.id):
            ref_tokens, ref_edges = run()
        assert ref_edges[last][3] - ref_edges[first][3] >= 4 * (last - first), ref_edges
        assert tokens == ref_tokens


def _batch_generate(model, prompts, max_tokens):
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens)
    uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
    out = {uid: [] for uid in uids}
    logprobs = {uid: [] for uid in uids}
    step = getattr(gen, "next_generated", None) or gen.next
    while True:
        responses = step()
        if not responses:
            break
        for r in responses:
            out[r.uid].append(r.token)
            logprobs[r.uid].append(r.logprobs)
    close = getattr(gen, "close", None)
    if close is not None:
        close()
    return [out[uid] for uid in uids], [mx.stack(logprobs[uid]) for uid in uids]


def test_batch_generator_tokens_identical():
    import mlx.core as mx

    if not _patched():
        pytest.skip(f"{PATCH.id} is not installed in this process")
    model = _tiny("llama")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12, 13, 14]]
    patched, logprobs = _batch_generate(model, prompts, 24)
    with without(PATCH.id):
        unpatched, ref_logprobs = _batch_generate(model, prompts, 24)
    assert all(len(t) == 24 for t in patched), patched
    assert patched == unpatched
    assert all(mx.array_equal(a, b, equal_nan=True).item() for a, b in zip(logprobs, ref_logprobs, strict=True))


def test_decode_runs_kvpatch_code_only_when_the_buffer_grows():
    """The hot-path rule, counted rather than timed: over 500 BatchGenerator decode steps of a llama, no function
    of offset-detach's runs except in the steps where a KV buffer grows (once per 256 tokens: the growth tie reads
    ``step``). The wrapper this replaced ran on every call of every layer."""
    import collections
    import sys

    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import BatchKVCache

    if not (_patched() and growth_period(BatchKVCache)):
        pytest.skip("the growth tie is not installed here (0.28.0 has no class attribute step: the wrapper runs)")
    model = _tiny("llama")
    gen = BatchGenerator(model, max_tokens=520)
    gen.insert([[1, 2, 3], [4, 5, 6, 7, 8]], max_tokens=[520, 520])
    step = getattr(gen, "next_generated", None) or gen.next
    for _ in range(5):
        step()
    # offset-detach's code: its module and the shared _lazy (offset-rebind, < 0.32.0, wraps every call on purpose)
    from kvpatch.patches import _lazy
    from kvpatch.patches.mlx_lm import offset_detach

    ours = (_lazy.growth_tie.__code__.co_filename, offset_detach.reproduce.__code__.co_filename)
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, _arg):
        if event == "call" and frame.f_code.co_filename in ours:
            calls[frame.f_code.co_name] += 1

    per_step = []
    sys.setprofile(profile)
    try:
        for _ in range(500):
            before = calls.total()
            step()
            per_step.append(calls.total() - before)
    finally:
        sys.setprofile(None)
    busy = {i: n for i, n in enumerate(per_step) if n}
    # 505 tokens after prompts of 3 and 5: the 256-token buffer grows once (twice at most, whatever the prefill)
    assert 1 <= len(busy) <= 2, (busy, calls)
    assert max(busy.values()) <= 2 * 5 * len(model.layers), (busy, calls)  # ``step`` read 5 times per growth
    assert set(calls) <= {"__get__", "get"}, calls


def test_step_reads_and_writes_as_upstream():
    """The served ``step`` behaves as upstream's class attribute: 256 on the class and on an instance, an
    instance's own value honoured (it sizes the buffer) and deletable, and the plain int back without the patch."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    if not (_patched() and growth_period(BatchKVCache)):
        pytest.skip("the growth tie is not installed here")
    assert BatchKVCache.step == 256 and type(BatchKVCache.step) is int
    cache = BatchKVCache([1, 0])
    assert cache.step == 256
    cache.step = 64
    k = mx.zeros((2, 2, 3, 8))
    cache.update_and_fetch(k, k)
    assert cache.keys.shape[2] == 64  # the instance's own step sized the buffer
    del cache.step
    assert cache.step == 256
    with pytest.raises(AttributeError):
        del cache.step
    with without(PATCH.id):
        assert type(vars(BatchKVCache)["step"]) is int and BatchKVCache([0]).step == 256
    assert isinstance(vars(BatchKVCache)["step"], ClassValue)
