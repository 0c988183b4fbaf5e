"""qwen35-batch-positions beyond its reproduction: a tiny Qwen3_5Attention over left-padded batches of several shapes
gives each row what it gives alone (prefill and decode), with ``position_ids`` left to the layer; given
``position_ids`` (what mlx-vlm's LanguageModel passes) or an integer offset, the layer gets exactly what it got
before."""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_vlm.qwen35_batch_positions import PATCH, batched_vs_alone, tiny_attention
from kvpatch.testing import require_affected, with_and_without, worst


@pytest.fixture(scope="module", autouse=True)
def _in_range():
    require_affected(PATCH)


@pytest.mark.parametrize("lengths", [(5, 9), (7, 3, 6), (4, 4)])
def test_batched_rows_equal_each_row_alone(lengths):
    found = worst(batched_vs_alone(tiny_attention(), lengths, steps=3))
    assert found.within, found


def test_given_positions_and_int_offsets_are_upstreams():
    import mlx.core as mx
    from mlx_vlm.models.cache import BatchKVCache, KVCache

    attention = tiny_attention()
    x = mx.random.normal((2, 5, 64), key=mx.random.key(3))
    positions = mx.broadcast_to(mx.arange(5)[None, None], (3, 2, 5))

    def run():
        cache = BatchKVCache([0, 0])
        given = attention(x, mask=cache.make_mask(5, return_array=True), cache=cache, position_ids=positions)
        single = attention(x[:1], mask="causal", cache=KVCache())
        return given.tolist(), single.tolist()

    patched, unpatched = with_and_without(PATCH.id, run)
    assert patched == unpatched
