"""empty-tq-rows (V03) beyond its reproduction: with TurboQuant on, a tiny random-weight mlx-vlm model
(pixtral's language model) decodes a batch merged from a prefilled and an empty BatchTurboQuantKVCache
(``full.extend(empty)`` and ``empty.extend(full)``, integer and fractional bits) with the same logits as
each row decoded alone; a merge of two prefilled caches (the path the patch leaves alone) still does.
"""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_vlm.empty_tq_rows import PATCH
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
    gap = quantization_gap()  # (the rows below are decoded batched and alone through TurboQuant codes)
    if gap:
        pytest.skip(gap)
    return tiny_pixtral_language_model(head_dim=32, heads=4, kv_heads=2)


def _caches(model, bits, prompt):
    import mlx.core as mx
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    caches = [BatchTurboQuantKVCache([0], bits=bits) for _ in model.layers]
    if prompt:
        model(mx.array([prompt]), cache=caches)
    return caches


def _decode(model, caches, tokens):
    import mlx.core as mx

    return mx.stack([model(mx.array(t)[:, None], cache=caches).logits[:, -1] for t in tokens], axis=1)


def _alone(model, bits, prompt, column):
    caches = _caches(model, bits, prompt)
    return _decode(model, caches, [[step[column]] for step in STEPS])[0]


@pytest.mark.parametrize("bits", [4, 3.5])
@pytest.mark.parametrize("order", ["full.extend(empty)", "empty.extend(full)"])
def test_merged_decode_matches_rows_alone(order, bits):

    model = _tiny_model()
    full, empty = _caches(model, bits, PROMPT), _caches(model, bits, None)
    merged, other = (full, empty) if order[0] == "f" else (empty, full)
    for a, b in zip(merged, other, strict=True):
        a.extend(b)
    p_full, p_empty = (0, 1) if order[0] == "f" else (1, 0)
    assert merged[0].left_padding.tolist()[p_empty] == len(PROMPT)
    batched = _decode(model, merged, STEPS)

    found = worst(
        [
            difference(
                batched[p_full], _alone(model, bits, PROMPT, p_full), where=f"{order}, {bits} bits: the full row"
            ),
            difference(
                batched[p_empty], _alone(model, bits, None, p_empty), where=f"{order}, {bits} bits: the empty row"
            ),
        ]
    )
    assert found.within, found


def test_merge_of_two_prefilled_caches_unchanged():

    model = _tiny_model()
    long, short = _caches(model, 4, PROMPT), _caches(model, 4, SHORT_PROMPT)
    for a, b in zip(long, short, strict=True):
        a.extend(b)
    assert long[0].left_padding.tolist() == [0, len(PROMPT) - len(SHORT_PROMPT)]
    batched = _decode(model, long, STEPS)
    for row, prompt in enumerate((PROMPT, SHORT_PROMPT)):
        found = difference(batched[row], _alone(model, 4, prompt, row), where=f"row {row}")
        assert found.within, found


def test_empty_side_adopts_the_codec_that_encoded_its_new_rows():
    """With a fractional key bit-width the codec picks its outlier channels from the first keys it sees,
    so the merged cache must keep the codec that encoded the rows it received (mlx-vlm 0.7.x)."""
    import inspect

    import mlx.core as mx
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    if "key_bits" not in inspect.signature(BatchTurboQuantKVCache).parameters:
        pytest.skip("this mlx-vlm has no key_bits: its codecs depend only on bits and seed")
    mx.random.seed(0)
    H, D = 2, 32
    prompt_k = mx.random.normal((1, H, 5, D)) * mx.linspace(0.1, 3.0, D)
    prompt_v = mx.random.normal((1, H, 5, D))
    step_k, step_v, q = (mx.random.normal((2, H, 1, D)) for _ in range(3))

    def new(prefill):
        cache = BatchTurboQuantKVCache([0], bits=4, key_bits=3.5, value_bits=2.5)
        if prefill:
            cache.update_and_fetch(prompt_k, prompt_v)
        return cache

    def attend(cache, k, v, queries):
        ks, vs = cache.update_and_fetch(k, v)
        keys, values = cache.dequantize(ks, vs)
        mask = mx.arange(keys.shape[-2])[None, None, None, :] >= cache.left_padding[:, None, None, None]
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=D**-0.5, mask=mask)

    merged = new(False)
    merged.extend(new(True))
    out = attend(merged, step_k, step_v, q)
    ref = attend(new(True), step_k[1:], step_v[1:], q[1:])
    found = difference(out[1], ref[0], where="the prefilled row against it decoded alone")
    assert found.within, found
