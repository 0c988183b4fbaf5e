"""batch-merge-empty (D1) beyond its reproduction: a tiny random-weight llama decodes a batch merged from a
prefilled and an empty single-sequence cache (both row orders, KVCache and RotatingKVCache rows, bf16)
with the logits of each row decoded alone; an all-empty merge gives an empty batch cache that prefills
like a fresh one (except on 0.30.4-0.31.1, where upstream still raises for it and this patch is out of
range: reported, not patched).
"""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_lm.batch_merge_empty import PATCH
from kvpatch.testing import difference, tiny_llama

PREFIX = [7, 3, 22, 41, 8]
NEXT = [[11, 12], [30, 31], [40, 41]]  # one decode step per entry: (filled row, empty row)


pytestmark = pytest.mark.requires_patch(PATCH.id)


@pytest.fixture(scope="module")
def model():
    import mlx.core as mx

    return tiny_llama(dtype=mx.bfloat16)


def _row_cache(kind: str):
    from mlx_lm.models import cache as C

    return C.KVCache() if kind == "kv" else C.RotatingKVCache(max_size=16)


def _batch_class(kind: str):
    from mlx_lm.models import cache as C

    return C.BatchKVCache if kind == "kv" else C.BatchRotatingKVCache


def _alone(model, kind, prefix, steps):
    """Logits of one sequence decoded alone, one step per entry of ``steps``."""
    import mlx.core as mx

    cache = [_row_cache(kind) for _ in model.layers]
    if prefix:
        model(mx.array([prefix]), cache=cache)
    out = []
    for tok in steps:
        out.append(model(mx.array([[tok]]), cache=cache)[0, -1].astype(mx.float32))
    return out


@pytest.mark.parametrize("kind", ["kv", "rotating"])
@pytest.mark.parametrize("empty_first", [False, True], ids=["filled+empty", "empty+filled"])
def test_merged_decode_matches_rows_alone(model, kind, empty_first):
    import mlx.core as mx

    filled = [_row_cache(kind) for _ in model.layers]
    model(mx.array([PREFIX]), cache=filled)
    empty = [_row_cache(kind) for _ in model.layers]
    rows = [empty, filled] if empty_first else [filled, empty]
    merged = [_batch_class(kind).merge([r[i] for r in rows]) for i in range(len(model.layers))]
    assert all(c.keys.dtype == mx.bfloat16 for c in merged)

    want_filled = _alone(model, kind, PREFIX, [s[0] for s in NEXT])
    want_empty = _alone(model, kind, [], [s[1] for s in NEXT])
    fi = 1 if empty_first else 0
    for step, (a, b) in enumerate(NEXT):
        toks = [[b], [a]] if empty_first else [[a], [b]]
        logits = model(mx.array(toks), cache=merged)[:, -1].astype(mx.float32)
        found = difference(logits[fi], want_filled[step], mx.bfloat16, where=f"filled row, step {step}")
        assert found.within, found
        found = difference(logits[1 - fi], want_empty[step], mx.bfloat16, where=f"empty row, step {step}")
        assert found.within, found


@pytest.mark.parametrize("kind", ["kv", "rotating"])
def test_all_empty_merge_is_a_fresh_batch_cache(model, kind):
    import importlib.metadata

    import mlx.core as mx
    from packaging.version import Version

    version = Version(importlib.metadata.version("mlx-lm"))
    if Version("0.30.4") <= version < Version("0.31.2"):
        pytest.skip(
            f"mlx-lm {version}: an all-empty merge raises upstream (fixed in 0.31.2), outside {PATCH.id}'s range"
        )

    merged = [_batch_class(kind).merge([_row_cache(kind), _row_cache(kind)]) for _ in model.layers]
    assert all(c.keys is None and c.left_padding.tolist() == [0, 0] for c in merged)
    got = model(mx.array([PREFIX, PREFIX[::-1]]), cache=merged)[:, -1].astype(mx.float32)
    for i, prompt in enumerate([PREFIX, PREFIX[::-1]]):
        cache = [_row_cache(kind) for _ in model.layers]
        want = model(mx.array([prompt]), cache=cache)[0, -1].astype(mx.float32)
        found = difference(got[i], want, mx.bfloat16, where=f"row {i}")
        assert found.within, found
