"""vlm-arrays-advance-detach at model level, on a tiny random mlx-vlm LFM2-VL language model (3 conv layers
with mlx-vlm's own ArraysCache, 1 attention layer): in a left-padded decode loop the conv caches'
left_padding stays bounded, and generated tokens and the final left_padding are identical patched vs
unpatched."""

from __future__ import annotations

import _deferred_metadata as checks
import pytest

import kvpatch
from kvpatch.gate import Action
from kvpatch.patches import _arrays
from kvpatch.patches._lazy import graph_edges
from kvpatch.patches.mlx_vlm.arrays_advance_detach import PATCH
from kvpatch.testing import import_targets, natural_decision, without


@pytest.fixture(scope="module", autouse=True)
def _in_range():
    decision = natural_decision(PATCH)
    if decision.action in (Action.NOT_INSTALLED, Action.OUT_OF_RANGE, Action.NOT_NEEDED):
        pytest.skip(f"{PATCH.id}: {decision.reason}")
    import_targets(PATCH)
    if _arrays.vlm_own_arrays_cache() is None:
        pytest.skip("this mlx-vlm has no ArraysCache of its own")


def _patched() -> bool:
    return bool(kvpatch.get_engine().status[PATCH.id].installed)


def _tiny_lfm2_vl():
    import mlx.core as mx
    from mlx_vlm.models.lfm2_vl.config import TextConfig
    from mlx_vlm.models.lfm2_vl.language import LanguageModel

    mx.random.seed(0)
    config = TextConfig(
        model_type="lfm2",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        vocab_size=97,
        block_dim=64,
        block_ff_dim=128,
        block_multiple_of=16,
        block_auto_adjust_ff_dim=False,
        conv_dim=64,
        conv_dim_out=64,
        conv_L_cache=3,
        rope_theta=10000.0,
        num_heads=4,
        layer_types=["conv", "conv", "full_attention", "conv"],
    )
    model = LanguageModel(config)
    mx.eval(model.parameters())
    return model


def test_left_padded_decode_loop_stays_bounded():
    import mlx.core as mx
    from mlx_vlm.models.cache import ArraysCache, BatchKVCache

    model = _tiny_lfm2_vl()

    def run():
        cache = [
            ArraysCache(1, left_padding=[2, 0]) if isinstance(c, ArraysCache) else BatchKVCache([2, 0])
            for c in model.make_cache()
        ]
        logits = model(mx.array([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]]), cache=cache).logits
        y = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(y)
        out, edges = [], {}
        for i in range(200):
            y = mx.argmax(model(y[:, None], cache=cache).logits[:, -1], axis=-1)
            mx.eval(y)
            out.append(y.tolist())
            if i + 1 in (50, 200):
                edges[i + 1] = [graph_edges(c.left_padding) for c in cache if isinstance(c, ArraysCache)]
        lp = [c.left_padding.tolist() for c in cache if isinstance(c, ArraysCache)]
        return out, edges, lp

    tokens, edges, lp = run()
    assert lp == [[2 - 205, 0 - 205]] * 3  # 5 prompt tokens + 200 decode steps advanced
    assert edges[50] == edges[200] and max(edges[200]) <= 10, edges  # measured with rebase_advance: 5, 10, 10
    if _patched():
        with without(PATCH.id):
            ref_tokens, ref_edges, ref_lp = run()
        assert max(ref_edges[200]) - max(ref_edges[50]) >= 4 * 150, ref_edges
        assert tokens == ref_tokens and lp == ref_lp


def _own_class() -> type:
    if not _patched():
        pytest.skip(f"{PATCH.id} is not installed in this process")
    return _arrays.vlm_own_arrays_cache()


def test_metadata_exact_when_the_patch_goes_out_and_back_mid_decode():
    checks.exact_when_taken_out_and_back(_own_class(), PATCH.id)


def test_steady_decoding_adds_nothing_to_the_graph():
    checks.nothing_joins_the_graph(_own_class())


def test_reads_do_not_stack():
    checks.reads_do_not_stack(_own_class())


def test_copies_stay_exact():
    checks.copies_stay_exact(_own_class(), PATCH.id)


def test_descriptors_behave_as_the_attributes():
    checks.behaves_as_an_attribute(_own_class())


def test_reads_are_pure_across_threads():
    checks.reads_are_pure(_own_class())


def test_never_none_during_advance():
    checks.never_none_during_advance(_own_class())


def test_copies_and_pickles_are_upstreams():
    checks.copies_and_pickles_are_upstreams(_own_class())


def test_pickle_loads_where_the_patch_is_off(run_py):
    checks.pickle_loads_where_the_patch_is_off(_own_class(), PATCH.id, run_py)


def test_edits_and_references_as_documented():
    checks.edits_and_references_as_documented(_own_class(), PATCH.id)


def test_vars_snapshot_restores_as_upstream():
    checks.vars_snapshot_restores_as_upstream(_own_class(), PATCH.id)
