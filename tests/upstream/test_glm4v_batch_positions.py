"""glm4v-batch-positions beyond its reproduction: a tiny GLM4VModel, and a fresh LanguageModel, of glm4v_moe and of
glm4v (the same code), over
left-padded batches of several shapes give each row what it gives alone (prefill and decode), with ``position_ids``
left to the model; given ``position_ids``, an integer offset or rope state already held, the model gets exactly what
it got before."""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_vlm.glm4v_batch_positions import (
    ARCHS,
    PATCH,
    batched_vs_alone,
    tiny_language_model,
    tiny_model,
)
from kvpatch.testing import difference, require_affected, with_and_without, worst


@pytest.fixture(scope="module", autouse=True)
def _in_range():
    require_affected(PATCH)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("build", [tiny_model, tiny_language_model], ids=["GLM4VModel", "fresh-LanguageModel"])
@pytest.mark.parametrize("lengths", [(5, 9), (7, 3, 6), (2, 8)])
def test_batched_rows_equal_each_row_alone(arch, build, lengths):
    found = worst(batched_vs_alone(build(arch), lengths, steps=3))
    assert found.within, found


def test_given_positions_and_int_offsets_are_upstreams():
    import mlx.core as mx
    from mlx_vlm.models.cache import BatchKVCache, KVCache

    model = tiny_model()
    tokens = mx.random.randint(1, 60, (2, 5), key=mx.random.key(3))
    positions = mx.broadcast_to(mx.arange(5)[None, None], (3, 2, 5))

    def run():
        given = model(tokens, cache=[BatchKVCache([0, 0]) for _ in model.layers], position_ids=positions)
        single = model(tokens[:1], cache=[KVCache() for _ in model.layers])
        return given.tolist(), single.tolist()

    patched, unpatched = with_and_without(PATCH.id, run)
    assert patched == unpatched


def test_language_model_with_rope_state_or_given_positions_is_upstreams():
    """Rope deltas held on the model (any earlier request) or ``position_ids`` given: upstream's own branches run."""
    import mlx.core as mx
    from mlx_vlm.models.cache import BatchKVCache

    model = tiny_language_model()
    tokens = mx.random.randint(1, 60, (2, 5), key=mx.random.key(3))
    positions = mx.broadcast_to(mx.arange(5)[None, None], (3, 2, 5))

    def run():
        model._rope_deltas, model._position_ids = mx.array([[2], [0]]), None
        held = model(tokens, cache=[BatchKVCache([1, 0]) for _ in model.layers]).logits
        model._rope_deltas = None
        given = model(tokens, cache=[BatchKVCache([1, 0]) for _ in model.layers], position_ids=positions).logits
        return held.tolist(), given.tolist()

    patched, unpatched = with_and_without(PATCH.id, run)
    assert patched == unpatched


def test_mlx_vlm_batch_generator_first_batch_rows_equal_each_row_alone():
    """mlx-vlm's own BatchGenerator (its server's and batch_generate's path) on a fresh model: a left-padded text batch
    first, then each row alone; every generated token's log-probability must match."""
    try:
        from mlx_vlm.generate.ar import BatchGenerator
        from mlx_vlm.utils import StoppingCriteria
    except ImportError:
        pytest.skip("this mlx-vlm has no mlx_vlm.generate.ar.BatchGenerator")
    from types import SimpleNamespace

    import mlx.core as mx

    model = tiny_language_model()
    prompts = [[5, 17, 3, 44, 9], [8, 1, 30, 22, 7, 41, 13, 2, 50]]

    def generate(batch: list[list[int]]) -> list[list[float]]:
        model._position_ids = None  # what glm4v_moe's Model.get_input_embeddings does for a text prompt
        tokenizer = SimpleNamespace(stopping_criteria=StoppingCriteria([], None))
        gen = BatchGenerator(model, tokenizer, max_tokens=4, prefill_step_size=None)
        embeds = [{"inputs_embeds": model.model.embed_tokens(mx.array([p]))} for p in batch]
        uids = gen.insert(batch, max_tokens=4, prompt_kwargs=embeds)
        out: dict[int, list[float]] = {uid: [] for uid in uids}
        while any(len(v) < 4 for v in out.values()):
            responses = gen.next()
            for r in responses[1] if isinstance(responses, tuple) else responses:
                out[r.uid].append(float(r.token_logprob))
        gen.close()
        return [out[uid] for uid in uids]

    batched = generate(prompts)
    alone = [generate([p])[0] for p in prompts]
    found = worst(difference(mx.array(row), mx.array(ref)) for row, ref in zip(batched, alone, strict=True))
    assert found.within, (found, batched, alone)
