"""rotating-merge-wrapped beyond the reproduction: a tiny random-weight llama decodes a batch merged from
RotatingKVCaches that went past their window (wrapped by decode steps; over-full after a long prompt) and
from a short one, with the logits of each row decoded alone. Also with an empty row next to them (on
0.28.4-0.30.2 batch-merge-empty handles that row, stacked under this patch), and the caller's caches
untouched.
"""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_lm.rotating_merge_wrapped import PATCH
from kvpatch.testing import difference, skip_unless_in_place, tiny_llama

WINDOW = 8
LONG = [7, 3, 22, 41, 8, 13, 2, 19, 30, 5, 11]  # 11 tokens: past the window in one chunk
SHORT = [5, 9, 2, 33, 17]
STEPS = [11, 30, 40]


pytestmark = pytest.mark.requires_patch(PATCH.id)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _row(model, kind):
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    caches = [RotatingKVCache(max_size=WINDOW) for _ in model.layers]
    if kind == "overfull":
        model(mx.array([LONG]), cache=caches)
    elif kind == "wrapped":
        model(mx.array([SHORT]), cache=caches)
        for t in LONG[:6]:
            model(mx.array([[t]]), cache=caches)
    elif kind == "short":
        model(mx.array([SHORT]), cache=caches)
    else:
        assert kind == "none"
    return caches


def _check(model, kinds):
    import mlx.core as mx
    from mlx_lm.models.cache import BatchRotatingKVCache

    rows = [_row(model, k) for k in kinds]
    merged = [BatchRotatingKVCache.merge([r[i] for r in rows]) for i in range(len(model.layers))]
    alone = {}
    for k in set(kinds):
        caches = _row(model, k)
        alone[k] = [model(mx.array([[t]]), cache=caches)[0, -1] for t in STEPS]
    for step, t in enumerate(STEPS):
        logits = model(mx.array([[t]] * len(kinds)), cache=merged)[:, -1]
        for i, k in enumerate(kinds):
            found = difference(
                logits[i], alone[k][step], where=f"row {i} ({k}), step {step}, from the row decoded alone"
            )
            assert found.within, found


@pytest.mark.parametrize("kinds", [["wrapped", "short"], ["short", "overfull"], ["overfull", "wrapped", "short"]])
def test_merged_decode_matches_rows_alone(model, kinds):
    _check(model, kinds)


def test_with_an_empty_row(model):
    skip_unless_in_place("batch-merge-empty", "the empty-row merge crash (0.28.4-0.30.2)")
    # (either stacking order: this patch rewrites only rows that hold tokens, batch-merge-empty only rows
    # without keys, into zero-length stand-ins that this patch leaves alone)
    _check(model, ["none", "wrapped", "overfull"])


def test_caller_rows_untouched(model):
    from mlx_lm.models.cache import BatchRotatingKVCache

    wrapped, overfull = _row(model, "wrapped"), _row(model, "overfull")
    before = [(c.keys.shape, c._idx, c.offset) for c in wrapped + overfull]
    for i in range(len(model.layers)):
        BatchRotatingKVCache.merge([wrapped[i], overfull[i]])
    assert [(c.keys.shape, c._idx, c.offset) for c in wrapped + overfull] == before
