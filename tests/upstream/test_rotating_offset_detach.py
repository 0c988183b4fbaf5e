"""rotating-offset-detach (B2) beyond its reproduction: flat offset/left_padding graphs over thousands of
steps, bit-identical cache contents through both update paths (in-place decode past the window, and
multi-token concat after rotation), and a real model: the layers whose left_padding nobody reads stay
bounded, and BatchGenerator tokens are identical patched vs unpatched.

On fixed releases (>= 0.31.1) the same tests check upstream's own fix.
"""

from __future__ import annotations

import pytest

import kvpatch
from kvpatch.patches.mlx_lm.rotating_offset_detach import PATCH, graph_edges
from kvpatch.testing import without

STEPS = 3000
WINDOW = 16


pytestmark = pytest.mark.requires_patch(PATCH.id)


def _patched() -> bool:
    return bool(kvpatch.get_engine().status[PATCH.id].installed)


def _decode(steps: int, checkpoints: tuple[int, ...] = (), dtype=None, concat_every: int = 0):
    """Left-padded BatchRotatingKVCache: prefill, then ``steps`` single-token updates (plus a 3-token
    update every ``concat_every`` steps), evaluating only the returned keys/values."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchRotatingKVCache

    dtype = dtype or mx.float32
    mx.random.seed(2)
    cache = BatchRotatingKVCache(WINDOW, [3, 1, 0])
    prompt = mx.random.normal((3, 2, 6, 16)).astype(dtype)
    mx.eval(cache.update_and_fetch(prompt, -prompt))
    tokens = mx.random.normal((steps, 3, 2, 3, 16)).astype(dtype)
    mx.eval(tokens)
    edges, outputs = {}, []
    for i in range(steps):
        step = tokens[i] if concat_every and (i + 1) % concat_every == 0 else tokens[i][:, :, :1]
        k, v = cache.update_and_fetch(step, step * 2)
        mx.eval(k, v)
        if concat_every:
            outputs.append((k, v))
        if i + 1 in checkpoints:
            edges[i + 1] = (graph_edges(cache.offset), graph_edges(cache.left_padding))
    return cache, outputs, edges


def test_graphs_flat_over_thousands_of_steps():
    checkpoints = (1000, 2000, STEPS)
    cache, _, edges = _decode(STEPS, checkpoints)
    assert cache.offset.tolist() == [6 - 3 + STEPS, 6 - 1 + STEPS, 6 + STEPS]
    assert all(max(e) <= 10 for e in edges.values()), edges
    assert edges[1000] == edges[2000] == edges[STEPS], edges
    if _patched():
        with without(PATCH.id):
            _, _, grown = _decode(STEPS, checkpoints)
        assert grown[STEPS][0] - grown[1000][0] >= 4 * 2000, grown
        assert grown[STEPS][1] - grown[1000][1] >= 4 * 2000, grown


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_contents_unchanged_through_both_update_paths(dtype_name):
    import mlx.core as mx

    if not _patched():
        pytest.skip(f"{PATCH.id} is not installed in this process")
    dtype = getattr(mx, dtype_name)
    cache, outputs, _ = _decode(120, dtype=dtype, concat_every=25)
    with without(PATCH.id):
        ref, ref_outputs, _ = _decode(120, dtype=dtype, concat_every=25)
    assert len(outputs) == len(ref_outputs) == 120
    for (k, v), (rk, rv) in zip(outputs, ref_outputs, strict=True):
        assert k.dtype == rk.dtype == dtype
        assert k.shape == rk.shape and mx.array_equal(k, rk).item() and mx.array_equal(v, rv).item()
    assert mx.array_equal(cache.offset, ref.offset).item()
    assert mx.array_equal(cache.left_padding, ref.left_padding).item()
    assert (cache._idx, cache._offset, cache.rotated) == (ref._idx, ref._offset, ref.rotated)


def _tiny_llama():
    import mlx.core as mx
    from mlx_lm.models import llama

    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=97,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def test_model_layers_stay_bounded():
    """The mask comes from cache[0]: cache[1]'s left_padding is read by nobody (RoPE or not)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchRotatingKVCache

    model = _tiny_llama()

    def run():
        cache = [BatchRotatingKVCache(WINDOW, [2, 0]) for _ in model.layers]
        y = mx.argmax(model(mx.array([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]]), cache=cache)[:, -1], axis=-1)
        mx.eval(y)
        out, edges = [], {}
        for i in range(250):
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
            mx.eval(y)
            out.append(y.tolist())
            if i + 1 in (50, 250):
                edges[i + 1] = graph_edges(cache[1].left_padding)
        return out, edges

    tokens, edges = run()
    assert edges[50] == edges[250] <= 10, edges
    if _patched():
        with without(PATCH.id):
            ref_tokens, ref_edges = run()
        assert ref_edges[250] - ref_edges[50] >= 4 * 200, ref_edges
        assert tokens == ref_tokens


def test_batch_generator_tokens_identical():
    """BatchGenerator on a model whose make_cache gives sliding-window caches (BatchRotatingKVCache)."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import RotatingKVCache

    if not _patched():
        pytest.skip(f"{PATCH.id} is not installed in this process")
    model = _tiny_llama()
    model.make_cache = lambda: [RotatingKVCache(max_size=WINDOW) for _ in model.layers]
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12, 13, 14]]

    def generate():
        gen = BatchGenerator(model, max_tokens=40)
        uids = gen.insert(prompts, max_tokens=[40] * len(prompts))
        tokens = {uid: [] for uid in uids}
        logprobs = {uid: [] for uid in uids}
        step = getattr(gen, "next_generated", None) or gen.next
        while responses := step():
            for r in responses:
                tokens[r.uid].append(r.token)
                logprobs[r.uid].append(r.logprobs)
        return [tokens[u] for u in uids], [mx.stack(logprobs[u]) for u in uids]

    patched, lp = generate()
    with without(PATCH.id):
        unpatched, ref_lp = generate()
    assert all(len(t) == 40 for t in patched), patched
    assert patched == unpatched
    assert all(mx.array_equal(a, b, equal_nan=True).item() for a, b in zip(lp, ref_lp, strict=True))
