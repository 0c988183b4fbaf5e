"""left-padding-mask (V01) beyond its reproduction: the masks of mlx-vlm's batch quantized and batch
TurboQuant caches equal mlx-lm BatchKVCache's for the same left padding (prefill and decode, with and
without ``return_array`` and a window), and left-padded batched prefill + decode of a tiny random-weight
mlx-vlm model (pixtral's language model, which builds its mask from ``cache[0]``) gives the same logits
as decoding each sequence alone.

On a fixed release (0.6.0+) the same tests check upstream's own masks.
"""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_vlm.left_padding_mask import PATCH
from kvpatch.testing import (
    difference,
    tiny_pixtral_language_model,
)

LEFT_PADDING = [3, 1, 0]
CASES = [  # (stage, N, return_array, window_size)
    ("prefill", 5, False, None),
    ("prefill", 5, True, None),
    ("prefill", 5, False, 3),
    ("decode", 1, False, None),
    ("decode", 1, True, None),
    ("decode", 1, False, 4),
    ("decode", 3, False, None),
    ("decode", 3, True, 2),
]


pytestmark = pytest.mark.requires_patch(PATCH.id)


def _make(kind: str, left_padding: list[int]):
    if kind == "quantized":
        from mlx_vlm.models.cache import BatchQuantizedKVCache

        return BatchQuantizedKVCache(left_padding, group_size=32, bits=8)
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    return BatchTurboQuantKVCache(left_padding, bits=4)


@pytest.mark.parametrize("kind", ["quantized", "turboquant"])
@pytest.mark.parametrize(("stage", "n", "return_array", "window"), CASES)
def test_mask_equals_mlx_lm_batch_kv_cache(kind, stage, n, return_array, window):
    import mlx.core as mx

    cache_mod = pytest.importorskip("mlx_lm.models.cache", reason="the reference BatchKVCache comes from mlx-lm")
    mx.random.seed(0)
    ours, reference = _make(kind, LEFT_PADDING), cache_mod.BatchKVCache(LEFT_PADDING)
    if stage == "decode":
        keys, values = mx.random.normal((3, 2, 5, 32)), mx.random.normal((3, 2, 5, 32))
        ours.update_and_fetch(keys, values)
        reference.update_and_fetch(keys + 0, values + 0)
    want = reference.make_mask(n, return_array=return_array, window_size=window)
    got = ours.make_mask(n, return_array=return_array, window_size=window)
    assert isinstance(got, mx.array), f"{kind} {stage}: make_mask returned {got!r}, not a mask array"
    assert got.shape == want.shape and got.dtype == want.dtype
    assert mx.array_equal(got, want).item()
    # the pad slots of row 0 are hidden from every query
    assert not got[0, ..., : LEFT_PADDING[0]].any().item()


def _tiny_model():
    # no grouped-query attention: mlx-lm <= 0.31.3's quantized SDPA breaks on it (A3)
    return tiny_pixtral_language_model(head_dim=32, heads=2, kv_heads=2)


@pytest.mark.parametrize("kind", ["quantized", "turboquant"])
def test_left_padded_batch_decode_matches_single_sequence(kind):
    import mlx.core as mx

    model = _tiny_model()
    prompts = [[5, 9, 13], [7, 3, 22, 41, 8, 19]]
    steps = [[11, 12], [30, 31], [40, 41]]
    width = max(map(len, prompts))
    left_padding = [width - len(p) for p in prompts]

    caches = [_make(kind, left_padding) for _ in model.layers]
    tokens = mx.array([[0] * lp + p for lp, p in zip(left_padding, prompts, strict=True)])
    batched = [model(tokens, cache=caches).logits[:, -1]]
    for step in steps:
        batched.append(model(mx.array(step)[:, None], cache=caches).logits[:, -1])
    batched = mx.stack(batched, axis=1)

    for row, prompt in enumerate(prompts):
        alone = [_make(kind, [0]) for _ in model.layers]
        single = [model(mx.array([prompt]), cache=alone).logits[:, -1]]
        for step in steps:
            single.append(model(mx.array([[step[row]]]), cache=alone).logits[:, -1])
        found = difference(
            batched[row], mx.stack(single, axis=1)[0], where=f"{kind}: row {row} (left padding {left_padding[row]})"
        )
        assert found.within, found
