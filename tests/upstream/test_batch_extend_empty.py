"""batch-extend-empty (D2+F1) beyond its reproduction: a tiny random-weight bf16 llama runs a prefilled
two-row batch joined with an empty batch (a one-token prompt needs no prefill), both ways round, with
BatchKVCache and BatchRotatingKVCache; every row then decodes with the logits of that row decoded alone
and the caches stay bfloat16 step after step. Two empty batches joined, then prefilled, also match.
"""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_lm.batch_extend_empty import PATCH
from kvpatch.testing import difference, tiny_llama

PROMPTS = [[7, 3, 22, 41, 8], [9, 13, 2]]
NEW = 17  # the one-token prompt that joins empty
STEPS = [[11, 12, 13], [30, 31, 32], [40, 41, 42]]  # (row 0, row 1, new row) per decode step
MAX_SIZE = 16


pytestmark = pytest.mark.requires_patch(PATCH.id)


@pytest.fixture(scope="module")
def model():
    import mlx.core as mx

    return tiny_llama(dtype=mx.bfloat16)


def _batch(kind, left_padding):
    from mlx_lm.models import cache as C

    if kind == "kv":
        return C.BatchKVCache(left_padding)
    if not hasattr(getattr(C, "BatchRotatingKVCache", None), "extend"):
        pytest.skip("BatchRotatingKVCache.extend first exists in mlx-lm 0.28.1")
    return C.BatchRotatingKVCache(MAX_SIZE, left_padding)


def _alone(model, kind, prefix, tokens):
    """Logits after each of ``tokens``, for one sequence decoded alone after prefilling ``prefix``."""
    import mlx.core as mx
    from mlx_lm.models import cache as C

    caches = [C.KVCache() if kind == "kv" else C.RotatingKVCache(max_size=MAX_SIZE) for _ in model.layers]
    if prefix:
        model(mx.array([prefix]), cache=caches)
    return [model(mx.array([[t]]), cache=caches)[0, -1].astype(mx.float32) for t in tokens]


def _prefilled(model, kind):
    """A left-padded two-row batch cache after prefilling PROMPTS."""
    import mlx.core as mx

    width = max(map(len, PROMPTS))
    padding = [width - len(p) for p in PROMPTS]
    caches = [_batch(kind, padding) for _ in model.layers]
    model(mx.array([[0] * pad + p for pad, p in zip(padding, PROMPTS, strict=True)]), cache=caches)
    return caches


def _decode_and_compare(model, kind, joined, order, prefixes):
    """Feed each source row its tokens through ``joined``; compare every step with the row alone."""
    import mlx.core as mx

    inputs = [[s[0] for s in STEPS], [s[1] for s in STEPS], [NEW] + [s[2] for s in STEPS[:-1]]]
    want = [_alone(model, kind, prefixes[r], inputs[r]) for r in range(3)]
    for step in range(len(STEPS)):
        tokens = mx.array([[inputs[r][step]] for r in order])
        logits = model(tokens, cache=joined)[:, -1].astype(mx.float32)
        assert all(c.keys.dtype == mx.bfloat16 for c in joined), f"step {step}: the joined cache is not bfloat16"
        for pos, r in enumerate(order):
            where = f"source row {r} (joined position {pos}), step {step}"
            found = difference(logits[pos], want[r][step], mx.bfloat16, where=where)  # bf16 weights and activations
            assert found.within, found


@pytest.mark.parametrize("kind", ["kv", "rotating"])
@pytest.mark.parametrize("empty_first", [False, True], ids=["full.extend(empty)", "empty.extend(full)"])
def test_joined_decode_matches_rows_alone(model, kind, empty_first):
    import mlx.core as mx

    full = _prefilled(model, kind)
    empty = [_batch(kind, [0]) for _ in model.layers]
    joined = []
    for f, e in zip(full, empty, strict=True):
        a, b = (e, f) if empty_first else (f, e)
        a.extend(b)
        joined.append(a)
    assert all(c.keys.dtype == mx.bfloat16 and c.keys.shape[0] == 3 for c in joined)
    if not empty_first:
        assert all(e.keys is None for e in empty), "extend modified the empty cache it was given"
    order = [2, 0, 1] if empty_first else [0, 1, 2]  # joined position -> source row (2: the one-token prompt)
    _decode_and_compare(model, kind, joined, order, [PROMPTS[0], PROMPTS[1], []])


@pytest.mark.parametrize("kind", ["kv", "rotating"])
def test_both_empty_then_prefill(model, kind):
    import mlx.core as mx

    a = [_batch(kind, [2]) for _ in model.layers]
    for c in a:
        c.extend(_batch(kind, [0]))
    assert all(c.left_padding.tolist() == [2, 0] and c.offset.tolist() == [-2, 0] for c in a)
    logits = model(mx.array([[0, 0, 5, 9], [4, 6, 5, 9]]), cache=a)[:, -1].astype(mx.float32)
    for i, prompt in enumerate([[5, 9], [4, 6, 5, 9]]):
        want = _alone(model, kind, prompt[:-1], prompt[-1:])[0]
        found = difference(logits[i], want, mx.bfloat16, where=f"row {i}")
        assert found.within, found
