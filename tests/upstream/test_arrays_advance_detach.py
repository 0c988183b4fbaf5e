"""arrays-advance-detach (B3) at model level, on a tiny random LFM2 (3 conv layers with ArraysCache, 1
attention layer): the conv caches' left_padding stays bounded in a left-padded decode loop and inside
mlx-lm's own BatchGenerator (where 0.31.3+ keep a zeros left_padding through decode), and generated
tokens and log-probabilities are identical patched vs unpatched.
"""

from __future__ import annotations

import _deferred_metadata as checks
import pytest
from _edges import MAX_EDGES

import kvpatch
from kvpatch.gate import Action
from kvpatch.patches._lazy import graph_edges
from kvpatch.patches.mlx_lm.arrays_advance_detach import PATCH
from kvpatch.testing import import_targets, natural_decision, without

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12, 13, 14]]


@pytest.fixture(scope="module", autouse=True)
def _in_range():
    decision = natural_decision(PATCH)
    if decision.action in (Action.NOT_INSTALLED, Action.OUT_OF_RANGE, Action.NOT_NEEDED):
        pytest.skip(f"{PATCH.id}: {decision.reason}")
    import_targets(PATCH)


def _patched() -> bool:
    return bool(kvpatch.get_engine().status[PATCH.id].installed)


def _tiny_lfm2():
    import mlx.core as mx
    from mlx_lm.models import lfm2

    mx.random.seed(0)
    args = lfm2.ModelArgs.from_dict(
        dict(
            model_type="lfm2",
            vocab_size=97,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            norm_eps=1e-5,
            conv_bias=False,
            conv_L_cache=3,
            block_dim=64,
            block_ff_dim=128,
            block_multiple_of=16,
            block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=False,
            rope_theta=10000.0,
            layer_types=["conv", "conv", "full_attention", "conv"],
        )
    )
    model = lfm2.Model(args)
    mx.eval(model.parameters())
    return model


def test_left_padded_decode_loop_stays_bounded():
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, BatchKVCache

    model = _tiny_lfm2()

    def run():
        cache = [
            ArraysCache(1, left_padding=[2, 0]) if isinstance(c, ArraysCache) else BatchKVCache([2, 0])
            for c in model.make_cache()
        ]
        y = mx.argmax(model(mx.array([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]]), cache=cache)[:, -1], axis=-1)
        mx.eval(y)
        out, edges = [], {}
        for i in range(200):
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
            mx.eval(y)
            out.append(y.tolist())
            if i + 1 in (50, 200):
                edges[i + 1] = [graph_edges(c.left_padding) for c in cache if isinstance(c, ArraysCache)]
        lp = [c.left_padding.tolist() for c in cache if isinstance(c, ArraysCache)]
        return out, edges, lp

    tokens, edges, lp = run()
    assert lp == [[2 - 205, 0 - 205]] * 3  # 5 prompt tokens + 200 decode steps advanced
    assert edges[50] == edges[200] and max(edges[200]) <= MAX_EDGES, edges
    if _patched():
        with without(PATCH.id):
            ref_tokens, ref_edges, ref_lp = run()
        assert max(ref_edges[200]) - max(ref_edges[50]) >= 4 * 150, ref_edges
        assert tokens == ref_tokens and lp == ref_lp


def _generator(model, max_tokens):
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens)
    uids = gen.insert(PROMPTS, max_tokens=[max_tokens] * len(PROMPTS))
    return gen, uids, getattr(gen, "next_generated", None) or gen.next


def test_batch_generator_conv_caches_stay_bounded():
    """mlx-lm 0.31.3+: merged fresh ArraysCaches keep left_padding=zeros(B) through decode."""
    from mlx_lm.models.cache import ArraysCache

    model = _tiny_lfm2()

    def run():
        gen, _, step = _generator(model, 400)
        for _ in range(300):
            step()
        batch = getattr(gen, "_generation_batch", None) or getattr(gen, "active_batch", None)
        caches = getattr(batch, "prompt_cache", None) or getattr(batch, "cache", None)
        if caches is None:
            pytest.skip("cannot find the generation batch's caches in this mlx-lm")
        return [
            graph_edges(c.left_padding) for c in caches if isinstance(c, ArraysCache) and c.left_padding is not None
        ]

    edges = run()
    if not edges:
        pytest.skip("this mlx-lm's BatchGenerator clears ArraysCache.left_padding before decoding (<= 0.31.2)")
    assert max(edges) <= MAX_EDGES, edges
    if _patched():
        with without(PATCH.id):
            grown = run()
        assert max(grown) >= 4 * 250, grown


def test_batch_generator_tokens_identical():
    import mlx.core as mx

    if not _patched():
        pytest.skip(f"{PATCH.id} is not installed in this process")
    model = _tiny_lfm2()

    def generate():
        _, uids, step = _generator(model, 30)
        tokens = {u: [] for u in uids}
        logprobs = {u: [] for u in uids}
        while responses := step():
            for r in responses:
                tokens[r.uid].append(r.token)
                logprobs[r.uid].append(r.logprobs)
        return [tokens[u] for u in uids], [mx.stack(logprobs[u]) for u in uids]

    patched, lp = generate()
    with without(PATCH.id):
        unpatched, ref_lp = generate()
    assert all(len(t) == 30 for t in patched), patched
    assert patched == unpatched
    assert all(mx.array_equal(a, b, equal_nan=True).item() for a, b in zip(lp, ref_lp, strict=True))


def _patched_only() -> None:
    if not _patched():
        pytest.skip(f"{PATCH.id} is not installed in this process")


def test_metadata_exact_when_the_patch_goes_out_and_back_mid_decode():
    from mlx_lm.models.cache import ArraysCache

    _patched_only()
    checks.exact_when_taken_out_and_back(ArraysCache, PATCH.id)


def test_steady_decoding_adds_nothing_to_the_graph():
    """No node joins what the layer evaluates (on mlx's CUDA backend a step whose graph differs from its
    neighbours' cost the 1.1B hybrid 5-8% of its decode speed, README)."""
    from mlx_lm.models.cache import ArraysCache

    _patched_only()
    checks.nothing_joins_the_graph(ArraysCache)


def test_reads_do_not_stack():
    from mlx_lm.models.cache import ArraysCache

    _patched_only()
    checks.reads_do_not_stack(ArraysCache)


def test_copies_stay_exact():
    from mlx_lm.models.cache import ArraysCache

    _patched_only()
    checks.copies_stay_exact(ArraysCache, PATCH.id)


def test_descriptors_behave_as_the_attributes():
    from mlx_lm.models.cache import ArraysCache

    _patched_only()
    checks.behaves_as_an_attribute(ArraysCache)


def test_a_failing_restore_hook_is_noted_not_raised():
    _patched_only()
    checks.restore_hook_errors_are_noted(PATCH)


def test_reads_are_pure_across_threads():
    from mlx_lm.models.cache import ArraysCache

    _patched_only()
    checks.reads_are_pure(ArraysCache)


def test_never_none_during_advance():
    from mlx_lm.models.cache import ArraysCache

    _patched_only()
    checks.never_none_during_advance(ArraysCache)


def test_copies_and_pickles_are_upstreams():
    from mlx_lm.models.cache import ArraysCache

    _patched_only()
    checks.copies_and_pickles_are_upstreams(ArraysCache)


def test_pickle_loads_where_the_patch_is_off(run_py):
    from mlx_lm.models.cache import ArraysCache

    _patched_only()
    checks.pickle_loads_where_the_patch_is_off(ArraysCache, PATCH.id, run_py)


def test_edits_and_references_as_documented():
    from mlx_lm.models.cache import ArraysCache

    _patched_only()
    checks.edits_and_references_as_documented(ArraysCache, PATCH.id)


def test_edits_and_references_as_mlx_vlm_fixed_its_own():
    """The same cases give the same results as mlx-vlm's own property-based fix (0.6.16+), where it is installed."""
    from mlx_lm.models.cache import ArraysCache

    _patched_only()
    fixed = checks.vlm_fixed_class()
    if fixed is None:
        pytest.skip("no mlx-vlm 0.6.16+ here")
    assert checks.edit_cases(ArraysCache) == checks.edit_cases(fixed)


def test_vars_snapshot_restores_as_upstream():
    from mlx_lm.models.cache import ArraysCache

    _patched_only()
    checks.vars_snapshot_restores_as_upstream(ArraysCache, PATCH.id)


SAVED = """
import json
from mlx_lm.models.cache import load_prompt_cache
cache = load_prompt_cache({path!r})[0]
cache.advance(1)
print(json.dumps([cache.left_padding.tolist(), cache.lengths.tolist()]))
"""


def test_saved_prompt_cache_loads_where_the_patch_is_off(run_py, tmp_path):
    """``save_prompt_cache`` writes ``state`` (0.32.0+: the arrays and both metadata, read through the descriptors):
    loaded with kvpatch off, ``advance(1)`` gives upstream's values."""
    import json

    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, save_prompt_cache

    _patched_only()
    cache = ArraysCache(1, left_padding=[2, 0])
    cache.prepare(lengths=[6, 4])
    cache[0] = mx.zeros((2, 3))
    cache.advance(5)
    if len(cache.state) != 3:
        pytest.skip("this mlx-lm's ArraysCache.state holds the arrays alone (no metadata is saved)")
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, [cache])
    out = json.loads(run_py(SAVED.format(path=path), env={"KVPATCH": "off"}).strip().splitlines()[-1])
    assert out == [[-4, -6], [0, -2]], out
