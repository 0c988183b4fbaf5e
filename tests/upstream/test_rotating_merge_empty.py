"""rotating-merge-empty (L-V11) beyond its reproduction: a tiny random-weight llama decodes a batch merged
from a zero-length RotatingKVCache that still holds a buffer and a prefilled one with the logits of each
row decoded alone (the zero-length row as a fresh cache). Two ways to be zero-length with storage: a
restored/reset slot (``offset = 0``, buffer kept) and a wrapped cache trimmed by its whole offset.

Overlap with batch-merge-empty (D1, 0.28.4-0.30.2), which changes the same method for rows with no keys:
a merge of [no-keys row, zero-length row with storage, filled row] needs both; each patch alone must
keep its own fix, and they must be stacked batch-merge-empty first.
"""

from __future__ import annotations

import pytest

import kvpatch
from kvpatch.gate import Action
from kvpatch.patches.mlx_lm.batch_merge_empty import PATCH as MERGE_EMPTY
from kvpatch.patches.mlx_lm.rotating_merge_empty import PATCH
from kvpatch.testing import (
    difference,
    import_targets,
    natural_decision,
    tiny_llama,
    without,
)

PREFIX = [7, 3, 22, 41, 8]
OTHER = [5, 9, 2, 33, 17, 21]
STEPS = [11, 30, 40]
MAX_SIZE = 16
TARGET = "mlx_lm.models.cache.BatchRotatingKVCache.merge"


pytestmark = pytest.mark.requires_patch(PATCH.id)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _rows(model, how):
    """One layer-list of RotatingKVCache per row kind."""
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    caches = [RotatingKVCache(max_size=MAX_SIZE) for _ in model.layers]
    if how == "none":
        return caches
    if how == "filled":
        model(mx.array([PREFIX]), cache=caches)
        return caches
    if how == "reset":  # a slot restored/reset to offset 0 that keeps its buffer
        model(mx.array([OTHER]), cache=caches)
        for c in caches:
            c.offset = 0
        return caches
    assert how == "trimmed"  # wrapped past max_size, then trimmed by its whole offset
    for tok in OTHER * 3:
        model(mx.array([[tok]]), cache=caches)
    for c in caches:
        c.trim(c.offset)
    return caches


def _alone(model, prefix):
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    caches = [RotatingKVCache(max_size=MAX_SIZE) for _ in model.layers]
    if prefix:
        model(mx.array([prefix]), cache=caches)
    return [model(mx.array([[t]]), cache=caches)[0, -1] for t in STEPS]


def _check_merged_decode(model, kinds):
    import mlx.core as mx
    from mlx_lm.models.cache import BatchRotatingKVCache

    rows = [_rows(model, k) for k in kinds]
    merged = [BatchRotatingKVCache.merge([r[i] for r in rows]) for i in range(len(model.layers))]
    want = {k: _alone(model, PREFIX if k == "filled" else []) for k in set(kinds)}
    for step, tok in enumerate(STEPS):
        logits = model(mx.array([[tok]] * len(kinds)), cache=merged)[:, -1]
        for i, k in enumerate(kinds):
            found = difference(
                logits[i], want[k][step], where=f"row {i} ({k}), step {step}, from the row decoded alone"
            )
            assert found.within, found


@pytest.mark.parametrize("how", ["reset", "trimmed"])
@pytest.mark.parametrize("empty_first", [True, False], ids=["empty+filled", "filled+empty"])
def test_merged_decode_matches_rows_alone(model, how, empty_first):
    _check_merged_decode(model, [how, "filled"] if empty_first else ["filled", how])


def test_caller_rows_untouched(model):
    from mlx_lm.models.cache import BatchRotatingKVCache

    empty, filled = _rows(model, "reset"), _rows(model, "filled")
    before = [(c.keys.shape, c._idx, c.offset) for c in empty]
    for i in range(len(model.layers)):
        BatchRotatingKVCache.merge([empty[i], filled[i]])
    assert [(c.keys.shape, c._idx, c.offset) for c in empty] == before


def _overlap_applies() -> bool:
    return natural_decision(MERGE_EMPTY).action is Action.APPLY and natural_decision(PATCH).action is Action.APPLY


def test_overlap_with_batch_merge_empty(model):
    if not _overlap_applies():
        pytest.skip(f"{MERGE_EMPTY.id} does not apply here: {natural_decision(MERGE_EMPTY).reason}")
    import_targets(MERGE_EMPTY)
    order = [
        pid for pid, path in kvpatch.get_engine().changes() if path == TARGET and pid in (MERGE_EMPTY.id, PATCH.id)
    ]
    assert order == [MERGE_EMPTY.id, PATCH.id]
    _check_merged_decode(model, ["none", "reset", "filled"])
    _check_merged_decode(model, ["trimmed", "filled", "none"])


def test_overlap_each_alone_keeps_its_fix(model):
    if not _overlap_applies():
        pytest.skip(f"{MERGE_EMPTY.id} does not apply here: {natural_decision(MERGE_EMPTY).reason}")
    with without(MERGE_EMPTY.id):
        _check_merged_decode(model, ["reset", "filled"])
    with without(PATCH.id):
        _check_merged_decode(model, ["none", "filled"])
