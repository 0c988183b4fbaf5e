"""max-kv-size-ignored: a model that builds its own cache gets the bound upstream gives models that do not.

Reference: the same llama weights in a model class without ``make_cache``, for which upstream itself builds
bounded caches. With the patch, ``make_prompt_cache``, ``generate_step(max_kv_size=...)`` and the batch
generator give a llama with ``make_cache`` (0.28.1+) the same layout and the same tokens. Mixed layouts
(sliding + global, recurrent state, chunked) keep every cache the model chose except unbounded KVCaches.
"""

from __future__ import annotations

import importlib

import pytest

from kvpatch.patches.mlx_lm.max_kv_size_ignored import PATCH, _layout, _tiny_cohere2
from kvpatch.testing import require_applies

mx = pytest.importorskip("mlx.core")


@pytest.fixture(scope="module")
def applied():
    require_applies(PATCH)
    return importlib.import_module("mlx_lm.models.cache")


def _llama_args(**extra):
    from mlx_lm.models import llama

    return llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-5,
        vocab_size=128,
        **extra,
    )


@pytest.fixture
def llama_pair(applied):
    """(llama with make_cache, the same weights in a class without it)."""
    from mlx.utils import tree_map
    from mlx_lm.models import llama

    if not hasattr(llama.Model, "make_cache"):
        pytest.skip("llama has no make_cache before mlx-lm 0.28.1")

    class WithoutMakeCache(llama.Model):
        @property
        def make_cache(self):
            raise AttributeError("make_cache")

    mx.random.seed(0)
    model = llama.Model(_llama_args())
    model.update(tree_map(lambda p: p * 2, model.parameters()))  # less flat than the default init
    plain = WithoutMakeCache(_llama_args())
    plain.update(model.parameters())
    mx.eval(model.parameters(), plain.parameters())
    assert hasattr(model, "make_cache") and not hasattr(plain, "make_cache")
    return model, plain


def _generate_step():
    module = importlib.import_module("mlx_lm.generate")
    return getattr(module, "generate_step", None) or importlib.import_module("mlx_lm.utils").generate_step


def test_cohere2_keeps_sliding_layer_and_bounds_global_layer(applied):
    model = _tiny_cohere2(window=8)
    assert _layout(applied.make_prompt_cache(model, 16)) == [("RotatingKVCache", 8), ("RotatingKVCache", 16)]
    assert _layout(applied.make_prompt_cache(model)) == [("RotatingKVCache", 8), ("KVCache", None)]
    bounded = applied.make_prompt_cache(model, 16)[1]
    assert bounded.keep == 4  # what upstream gives models without make_cache


def test_mixed_layouts_keep_everything_but_unbounded_kvcache(applied):
    from mlx_lm.models import llama

    c = applied
    if hasattr(llama.Model, "make_cache"):
        sliding = llama.Model(_llama_args(layer_types=["sliding_attention", "full_attention"], sliding_window=4))
        assert _layout(c.make_prompt_cache(sliding, 32)) == [("RotatingKVCache", 4), ("RotatingKVCache", 32)]

    kinds = [lambda: c.KVCache(), lambda: c.RotatingKVCache(max_size=64)]
    if hasattr(c, "ArraysCache"):
        kinds.append(lambda: c.ArraysCache(2))
    if hasattr(c, "ChunkedKVCache"):
        kinds.append(lambda: c.ChunkedKVCache(8))
    if hasattr(c, "CacheList"):
        kinds.append(lambda: c.CacheList(c.KVCache(), c.KVCache()))

    class Custom(llama.Model):
        def make_cache(self):
            return [make() for make in kinds]

    model = Custom(_llama_args())
    own = model.make_cache()
    bounded = c.make_prompt_cache(model, 16)
    assert type(bounded[0]) is c.RotatingKVCache and bounded[0].max_size == 16
    for mine, theirs in zip(bounded[1:], own[1:], strict=True):
        assert type(mine) is type(theirs)
    assert bounded[1].max_size == 64
    assert [type(x) for x in c.make_prompt_cache(model)] == [type(x) for x in own]


def test_make_prompt_cache_matches_model_without_make_cache(applied, llama_pair):
    model, plain = llama_pair
    assert _layout(applied.make_prompt_cache(model, 16)) == _layout(applied.make_prompt_cache(plain, 16))
    assert [c.keep for c in applied.make_prompt_cache(model, 16)] == [4, 4]


def test_generate_step_bounded_and_same_tokens(llama_pair):
    model, plain = llama_pair
    step = _generate_step()
    used = []
    recorded_call = type(model).__call__

    class Recording(type(model)):
        def __call__(self, inputs, *args, **kwargs):
            used.append(kwargs["cache"] if "cache" in kwargs else args[0])
            return recorded_call(self, inputs, *args, **kwargs)

    model.__class__ = Recording
    mx.random.seed(1)
    prompt = mx.random.randint(0, 128, (40,))

    def tokens(m):
        return [int(t) for t, _ in step(prompt, m, max_kv_size=16, max_tokens=12)]

    got = tokens(model)
    final = used[-1]
    assert _layout(final) == [("RotatingKVCache", 16)] * 2
    assert all(c.keys.shape[2] <= 16 for c in final)
    assert got == tokens(plain)


def _batch_tokens(generator, prompts, max_tokens):
    uids = generator.insert(prompts, max_tokens=[max_tokens] * len(prompts))
    out = {u: [] for u in uids}
    finished = set()
    for _ in range(10 * max_tokens + 100):
        responses = generator.next()
        if isinstance(responses, tuple):  # 0.31.2+: (prompt responses, generation responses)
            responses = responses[1]
        for r in responses:
            out[r.uid].append(r.token)
            if r.finish_reason is not None:
                finished.add(r.uid)
        if len(finished) == len(uids):
            break
    return [out[u] for u in uids]


def test_batch_generator_bounded_and_same_tokens(llama_pair):
    import inspect

    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

    generate = importlib.import_module("mlx_lm.generate")
    if "max_kv_size" not in inspect.signature(generate.BatchGenerator.__init__).parameters:
        pytest.skip("this release's BatchGenerator takes no max_kv_size")
    model, plain = llama_pair
    seen = []
    recorded_call = type(model).__call__

    class Recording(type(model)):
        def __call__(self, inputs, *args, **kwargs):
            seen.append(kwargs["cache"] if "cache" in kwargs else args[0])
            return recorded_call(self, inputs, *args, **kwargs)

    model.__class__ = Recording
    mx.random.seed(2)
    prompts = [mx.random.randint(0, 128, (n,)).tolist() for n in (30, 21)]

    got = _batch_tokens(generate.BatchGenerator(model, max_kv_size=16), prompts, 10)
    decode = seen[-1]
    assert not any(type(c) is BatchKVCache for c in decode), [type(c).__name__ for c in decode]
    assert all(type(c) is BatchRotatingKVCache and c.max_size == 16 for c in decode)
    assert all(c.keys.shape[2] <= 16 for c in decode)
    assert got == _batch_tokens(generate.BatchGenerator(plain, max_kv_size=16), prompts, 10)
