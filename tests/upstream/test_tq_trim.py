"""tq-trim (V05+V06) beyond its reproduction, on a tiny random-weight mlx-vlm model (pixtral's language
model, 2 layers, hidden 64) running on batch TurboQuant caches with a left-padded batch:

* a speculative round (a 3-token verify block) rolled back with ``trim`` or with Gemma 4's own
  ``rollback_speculative_cache`` gives the same next-token logits as never having appended the rejected
  tokens, and the decode mask shrinks with it;
* a ragged rollback (rows accept different numbers of drafts) through Gemma 4's rollback no longer
  raises: the row that accepted everything decodes as if nothing was rejected, the other row's rejected
  slots dequantize to exactly 0 (what mlx-vlm 0.6.4–0.6.17 do; 0.7.0+ refuses ragged acceptance, see the
  patch docstring);
* ``zero_row_tail`` on the single-row cache also refreshes its cached state slice.

On fixed releases (0.6.4+) the same tests check upstream's own fix.
"""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_vlm.tq_trim import PATCH
from kvpatch.testing import (
    difference,
    skip_unless_in_place,
    tiny_pixtral_language_model,
)

PROMPTS = [[7, 3, 22, 41, 8, 5], [9, 13, 17, 2]]
BLOCK = [[11, 12, 13], [30, 31, 32]]  # verify block of a speculative round: last token + 2 drafts
NEXT = [[40], [50]]


pytestmark = pytest.mark.requires_patch(PATCH.id)


@pytest.fixture(scope="module", autouse=True)
def _in_range():
    # The batch is left-padded: on releases with V01 the decode mask needs left-padding-mask.
    skip_unless_in_place("left-padding-mask", "V01 (left padding not masked)")


@pytest.fixture(scope="module")
def model():
    return tiny_pixtral_language_model(head_dim=32, heads=4, kv_heads=2)


def _prefilled(model, bits=4):
    import mlx.core as mx
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    width = max(len(p) for p in PROMPTS)
    padding = [width - len(p) for p in PROMPTS]
    caches = [BatchTurboQuantKVCache(padding, bits=bits) for _ in model.layers]
    tokens = mx.array([[0] * pad + p for pad, p in zip(padding, PROMPTS, strict=True)])
    model(tokens, cache=caches)
    return caches


def _logits(model, caches, tokens):
    import mlx.core as mx

    return model(mx.array(tokens), cache=caches).logits[:, -1]


def _gemma4_rollback(caches, accepted, block_size):
    import mlx.core as mx
    from mlx_vlm.models.gemma4.language import LanguageModel

    return LanguageModel.rollback_speculative_cache(None, caches, [], mx.array(accepted), block_size)


@pytest.mark.parametrize("how", ["trim", "gemma4 rollback"])
@pytest.mark.parametrize("bits", [4, 3.5])
def test_rollback_gives_never_appended_logits(model, how, bits):

    accepted = 1  # keep the block's first two tokens, reject the last
    rolled = _prefilled(model, bits)
    _logits(model, rolled, BLOCK)
    if how == "trim":
        assert all(c.is_trimmable() for c in rolled)
        assert [c.trim(len(BLOCK[0]) - accepted - 1) for c in rolled] == [1] * len(rolled)
    else:
        assert _gemma4_rollback(rolled, [accepted, accepted], len(BLOCK[0])) == accepted
    never = _prefilled(model, bits)
    _logits(model, never, [row[: accepted + 1] for row in BLOCK])
    assert [c._idx for c in rolled] == [c._idx for c in never]
    assert rolled[0].make_mask(1, return_array=True).shape == never[0].make_mask(1, return_array=True).shape
    found = difference(
        _logits(model, rolled, NEXT), _logits(model, never, NEXT), where="after rollback, never-appended"
    )
    assert found.within, found


def test_full_trim_of_the_round(model):

    rolled = _prefilled(model)
    _logits(model, rolled, BLOCK)
    assert [c.trim(3) for c in rolled] == [3, 3]
    never = _prefilled(model)
    found = difference(_logits(model, rolled, NEXT), _logits(model, never, NEXT), where="after trim(3), never-appended")
    assert found.within, found


def test_ragged_gemma4_rollback(model):
    import mlx.core as mx

    rolled = _prefilled(model)
    _logits(model, rolled, BLOCK)
    before = [c.dequantize() for c in rolled]
    # row 0 accepts no draft (keeps 1 of 3 block slots), row 1 accepts both (keeps all 3)
    try:
        assert _gemma4_rollback(rolled, [0, 2], 3) == 2
    except RuntimeError as exc:  # mlx-vlm 0.7.0+: ragged acceptance is refused (Blaizzy/mlx-vlm#1962)
        if "uniform" not in str(exc):
            raise
        pytest.skip(f"this mlx-vlm refuses ragged rollbacks: {exc}")
    for cache, (k0, v0) in zip(rolled, before, strict=True):
        k, v = cache.dequantize()
        idx = cache._idx
        assert mx.all(k[0, :, idx - 2 :] == 0).item() and mx.all(v[0, :, idx - 2 :] == 0).item()
        assert mx.array_equal(k[0, :, : idx - 2], k0[0, :, : idx - 2]) and mx.array_equal(k[1], k0[1])
        assert mx.array_equal(v[1], v0[1])
    full = _prefilled(model)
    _logits(model, full, BLOCK)
    found = difference(
        _logits(model, rolled, NEXT)[1], _logits(model, full, NEXT)[1], where="every draft accepted, no rollback"
    )
    assert found.within, found


def test_single_row_zero_row_tail_refreshes_its_state():
    import mlx.core as mx
    from mlx_vlm.turboquant import TurboQuantKVCache

    mx.random.seed(1)
    cache = TurboQuantKVCache(bits=4)
    cache.update_and_fetch(mx.random.normal((1, 2, 6, 32)), mx.random.normal((1, 2, 6, 32)))
    k_before = cache.dequantize(*cache.state)[0]  # ``state`` caches its slice
    cache.zero_row_tail(0, 4, 6)
    k, v = cache.dequantize(*cache.state)
    assert mx.all(k[..., 4:, :] == 0).item() and mx.all(v[..., 4:, :] == 0).item()
    assert mx.array_equal(k[..., :4, :], k_before[..., :4, :])
