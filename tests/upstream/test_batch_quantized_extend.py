"""batch-quantized-extend (V02) beyond its reproduction: a tiny random-weight mlx-vlm model (pixtral's
language model) decodes a batch merged from a prefilled and an empty BatchQuantizedKVCache
(``full.extend(empty)`` and ``empty.extend(full)``) with the same logits as each row decoded alone, and a
merge of two prefilled caches (the path the patch leaves alone) still does.

On a fixed release (0.6.0+) the same tests check upstream's own ``extend``.
"""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_vlm.batch_quantized_extend import PATCH
from kvpatch.testing import (
    difference,
    quantization_gap,
    skip_unless_in_place,
    tiny_pixtral_language_model,
    worst,
)

PROMPT = [7, 3, 22, 41, 8]
SHORT_PROMPT = [9, 13]
STEPS = [[11, 12], [30, 31], [40, 41]]


pytestmark = pytest.mark.requires_patch(PATCH.id)


@pytest.fixture(scope="module", autouse=True)
def _in_range():
    # The merged batch is left-padded: on releases with V01 the decode mask needs left-padding-mask.
    skip_unless_in_place("left-padding-mask", "V01 (left padding not masked)")


def _tiny_model():
    gap = quantization_gap()  # (the rows below are decoded batched and alone through 8-bit affine codes)
    if gap:
        pytest.skip(gap)
    # no grouped-query attention: mlx-lm <= 0.31.3's quantized SDPA breaks on it (A3)
    return tiny_pixtral_language_model(head_dim=32, heads=2, kv_heads=2)


def _caches(model, prompt):
    import mlx.core as mx
    from mlx_vlm.models.cache import BatchQuantizedKVCache

    caches = [BatchQuantizedKVCache([0], group_size=32, bits=8) for _ in model.layers]
    if prompt:
        model(mx.array([prompt]), cache=caches)
    return caches


def _decode(model, caches, tokens):
    import mlx.core as mx

    return mx.stack([model(mx.array(t)[:, None], cache=caches).logits[:, -1] for t in tokens], axis=1)


def _alone(model, prompt, column):
    return _decode(model, _caches(model, prompt), [[step[column]] for step in STEPS])[0]


@pytest.mark.parametrize("order", ["full.extend(empty)", "empty.extend(full)"])
def test_merged_decode_matches_rows_alone(order):

    model = _tiny_model()
    full, empty = _caches(model, PROMPT), _caches(model, None)
    merged, other = (full, empty) if order[0] == "f" else (empty, full)
    for a, b in zip(merged, other, strict=True):
        a.extend(b)
    p_full, p_empty = (0, 1) if order[0] == "f" else (1, 0)
    assert merged[0].left_padding.tolist()[p_empty] == len(PROMPT)
    batched = _decode(model, merged, STEPS)

    found = worst(
        [
            difference(batched[p_full], _alone(model, PROMPT, p_full), where=f"{order}: the full row"),
            difference(batched[p_empty], _alone(model, None, p_empty), where=f"{order}: the empty row"),
        ]
    )
    assert found.within, found


def test_merge_of_two_prefilled_caches_unchanged():

    model = _tiny_model()
    long, short = _caches(model, PROMPT), _caches(model, SHORT_PROMPT)
    for a, b in zip(long, short, strict=True):
        a.extend(b)
    assert long[0].left_padding.tolist() == [0, len(PROMPT) - len(SHORT_PROMPT)]
    batched = _decode(model, long, STEPS)
    for row, prompt in enumerate((PROMPT, SHORT_PROMPT)):
        found = difference(batched[row], _alone(model, prompt, row), where=f"row {row}")
        assert found.within, found
