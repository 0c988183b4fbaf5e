"""falcon-ocr-batch-positions beyond its reproduction: a tiny falcon_ocr language model over left-padded batches of
several shapes gives each prompt what it gives alone (the prompt and 3 decode steps), with no positions given; an
unpadded batch, a single-row cache and given positions get exactly what upstream gives them."""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_vlm.falcon_ocr_batch_positions import PATCH, batched_vs_alone, tiny_model
from kvpatch.testing import require_affected, with_and_without, worst

# Fails without the patch on an affected release, passes with it:
#   KVPATCH_DISABLE=falcon-ocr-batch-positions .venv/bin/python scripts/in_bucket.py vlm-0.7.10 -- \
#       python -m pytest tests/upstream/test_falcon_ocr_batch_positions.py -q   # fails
#   .venv/bin/python scripts/in_bucket.py vlm-0.7.10 -- python -m pytest tests/upstream/test_falcon_ocr_batch_positions.py -q


@pytest.fixture(scope="module", autouse=True)
def _in_range():
    require_affected(PATCH)


@pytest.mark.parametrize("lengths", [(5, 2, 4), (3, 7), (6, 1)])
def test_batched_prompts_equal_each_prompt_alone(lengths):
    found = worst(batched_vs_alone(tiny_model(), lengths, steps=3))
    assert found.within, found


def test_unpadded_batches_single_rows_and_given_positions_are_upstreams():
    import mlx.core as mx
    from mlx_vlm.models.cache import BatchKVCache, KVCache

    tokens = mx.array([[5, 9, 14, 3], [7, 2, 8, 11]])

    def run():
        model = tiny_model()
        unpadded = model(tokens, cache=[BatchKVCache([0, 0]) for _ in model.layers]).logits
        single = model(tokens[:1], cache=[KVCache() for _ in model.layers]).logits
        padded = [BatchKVCache([2, 0]) for _ in model.layers]
        given = model.model(tokens, cache=padded, position_ids=mx.broadcast_to(mx.arange(4), (2, 4)))
        return unpadded.tolist(), single.tolist(), given.tolist()

    patched, unpatched = with_and_without(PATCH.id, run)
    assert patched == unpatched
