"""vlm-batch-extend-dtype (mlx-vlm's copy of D2+F1) beyond its reproduction: a tiny random-weight pixtral language
model in bfloat16 and float16 runs a prefilled two-row batch joined with an empty one-row batch (a one-token
prompt needs no prefill), both ways round, with mlx-vlm's BatchKVCache and BatchRotatingKVCache; every row
then decodes with the logits of that row decoded alone and the caches keep the model's dtype step after step.
Also: the caller's empty cache is left as it was, two empty batches still join, ``self`` is not left with
stand-in keys when the original raises, and below the range (mlx-vlm re-exporting mlx-lm's classes) the
join keeps bfloat16 with kvpatch installed (mlx-lm's own ``batch-extend-empty`` patch, or a fixed mlx-lm).
"""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_vlm.batch_extend_dtype import PATCH
from kvpatch.testing import difference, require_affected, tiny_pixtral_language_model

PROMPTS = [[7, 3, 22, 41, 8], [9, 13, 2]]
NEW = 17  # the one-token prompt that joins empty
STEPS = [[11, 12, 13], [30, 31, 32], [40, 41, 42]]  # (row 0, row 1, new row) per decode step
MAX_SIZE = 16
DTYPES = ("bfloat16", "float16")


def _own_classes() -> bool:
    from mlx_vlm.models import cache as C

    return C.BatchKVCache.__module__.startswith("mlx_vlm.")


@pytest.fixture(scope="module")
def in_range():
    require_affected(PATCH)


@pytest.fixture(scope="module", params=DTYPES)
def dtype(request):
    return request.param


@pytest.fixture(scope="module")
def model(in_range, dtype):
    import mlx.core as mx

    return tiny_pixtral_language_model(head_dim=16, heads=4, kv_heads=2, dtype=getattr(mx, dtype))


def _logits(model, tokens, caches):
    import mlx.core as mx

    out = model(mx.array(tokens), cache=caches)
    logits = out.logits if hasattr(out, "logits") else out
    return logits[:, -1, :].astype(mx.float32)


def _batch(kind, left_padding):
    from mlx_vlm.models import cache as C

    return C.BatchKVCache(left_padding) if kind == "kv" else C.BatchRotatingKVCache(MAX_SIZE, left_padding)


def _alone(model, kind, prefix, tokens):
    """Logits after each of ``tokens``, for one sequence decoded alone after prefilling ``prefix``."""
    from mlx_vlm.models import cache as C

    caches = [C.KVCache() if kind == "kv" else C.RotatingKVCache(max_size=MAX_SIZE) for _ in model.layers]
    if prefix:
        _logits(model, [prefix], caches)
    return [_logits(model, [[t]], caches)[0] for t in tokens]


def _prefilled(model, kind):
    """A left-padded two-row batch cache after prefilling PROMPTS."""
    width = max(map(len, PROMPTS))
    padding = [width - len(p) for p in PROMPTS]
    caches = [_batch(kind, padding) for _ in model.layers]
    _logits(model, [[0] * pad + p for pad, p in zip(padding, PROMPTS, strict=True)], caches)
    return caches


@pytest.mark.parametrize("kind", ["kv", "rotating"])
@pytest.mark.parametrize("empty_first", [False, True], ids=["full.extend(empty)", "empty.extend(full)"])
def test_joined_decode_matches_rows_alone(model, dtype, kind, empty_first):
    import mlx.core as mx

    want_dtype = getattr(mx, dtype)
    full = _prefilled(model, kind)
    assert all(c.keys.dtype == want_dtype for c in full)
    empty = [_batch(kind, [0]) for _ in model.layers]
    joined = []
    for f, e in zip(full, empty, strict=True):
        a, b = (e, f) if empty_first else (f, e)
        a.extend(b)
        joined.append(a)
    assert all(c.keys.dtype == want_dtype and c.values.dtype == want_dtype for c in joined), [
        (c.keys.dtype, c.values.dtype) for c in joined
    ]
    assert all(c.keys.shape[0] == 3 and c.offset.shape[0] == 3 and c.left_padding.shape[0] == 3 for c in joined)
    if not empty_first:
        assert all(e.keys is None and e.values is None for e in empty), "extend modified the empty cache it was given"

    order = [2, 0, 1] if empty_first else [0, 1, 2]  # joined position -> source row (2: the one-token prompt)
    inputs = [[s[0] for s in STEPS], [s[1] for s in STEPS], [NEW] + [s[2] for s in STEPS[:-1]]]
    prefixes = [PROMPTS[0], PROMPTS[1], []]
    want = [_alone(model, kind, prefixes[r], inputs[r]) for r in range(3)]
    for step in range(len(STEPS)):
        logits = _logits(model, [[inputs[r][step]] for r in order], joined)
        assert all(c.keys.dtype == want_dtype for c in joined), f"step {step}: the joined cache is not {dtype}"
        for pos, r in enumerate(order):
            where = f"source row {r} (joined position {pos}), step {step}"
            found = difference(logits[pos], want[r][step], getattr(mx, dtype), where=where)
            assert found.within, found


@pytest.mark.parametrize("kind", ["kv", "rotating"])
def test_both_empty_then_prefill(model, dtype, kind):
    import mlx.core as mx

    a = [_batch(kind, [2]) for _ in model.layers]
    for c in a:
        c.extend(_batch(kind, [0]))
    assert all(c.keys is None and c.left_padding.tolist() == [2, 0] and c.offset.tolist() == [-2, 0] for c in a)
    logits = _logits(model, [[0, 0, 5, 9], [4, 6, 5, 9]], a)
    assert all(c.keys.dtype == getattr(mx, dtype) for c in a)
    for i, prompt in enumerate([[5, 9], [4, 6, 5, 9]]):
        want = _alone(model, kind, prompt[:-1], prompt[-1:])[0]
        found = difference(logits[i], want, getattr(mx, dtype), where=f"row {i}")
        assert found.within, found


@pytest.mark.parametrize("kind", ["kv", "rotating"])
def test_self_keeps_no_keys_when_the_original_raises(in_range, kind):
    import mlx.core as mx

    full = _batch(kind, [0])
    full.update_and_fetch(mx.zeros((1, 2, 3, 4), mx.bfloat16), mx.zeros((1, 2, 3, 4), mx.bfloat16))
    del full._idx  # any failure inside the original will do
    empty = _batch(kind, [0])
    with pytest.raises(AttributeError):
        empty.extend(full)
    assert empty.keys is None and empty.values is None


def test_below_range_mlx_lm_classes_keep_bfloat16():
    """mlx-vlm < 0.6.4 re-exports mlx-lm's classes: the join is mlx-lm's, covered by batch-extend-empty."""
    import mlx.core as mx

    C = pytest.importorskip("mlx_vlm.models.cache", reason="mlx-vlm is not installed")
    if not hasattr(C, "BatchKVCache"):
        pytest.skip("this mlx-vlm has no batch caches")
    if _own_classes():
        pytest.skip("mlx-vlm has its own batch caches here (0.6.4+): covered by this patch")
    for make in (lambda n: C.BatchKVCache([0] * n), lambda n: C.BatchRotatingKVCache(MAX_SIZE, [0] * n)):
        for empty_first in (False, True):
            full, empty = make(2), make(1)
            full.update_and_fetch(mx.ones((2, 2, 5, 8), mx.bfloat16), mx.ones((2, 2, 5, 8), mx.bfloat16))
            a, b = (empty, full) if empty_first else (full, empty)
            a.extend(b)
            assert a.keys.dtype == mx.bfloat16 and a.keys.shape[0] == 3, (type(a).__name__, empty_first, a.keys.dtype)
