"""batch-merge-empty (catalogue D1): merging per-row caches into a batch cache crashes on an empty row.

Broken: in mlx-lm 0.28.4–0.30.2 ``BatchKVCache.merge`` and ``BatchRotatingKVCache.merge`` copy every
row's keys without checking that the row has any. A row whose single-sequence cache was never filled
(``keys is None``, e.g. a prompt with no cached prefix next to one with a prefix) crashes the merge:
``TypeError: 'NoneType' object is not subscriptable`` (BatchKVCache) and ``AttributeError: 'NoneType'
object has no attribute 'shape'`` (BatchRotatingKVCache). When every row is empty both raise
``ValueError: max() arg is an empty sequence``. ``BatchGenerator`` merges prompt caches this way.

Upstream: ml-explore/mlx-lm#755 (63c98736), released in 0.30.4 (measured: one empty row is fine there).
Not covered by that fix and left to upstream here: all rows empty still raises on 0.30.4–0.31.1 (fixed in
0.31.2 by 3f9d179f, #1072); this patch only handles it inside its own range.

Fix: a delta in front of the original. Every empty row is replaced, for the merge only, by a shallow copy
whose keys and values are zero-length arrays with the head count, head dims and dtype of a filled row;
the original then copies zero tokens for it and left-pads it fully, which is how it already treats a
short row. The caller's caches are not touched. When no row has keys there is nothing to take shapes
from: the result is a fresh, empty batch cache with no padding (what 0.31.2 returns). Merge runs once per
new batch, not per token.

Composition: ``rotating-merge-empty`` (order 110) also changes ``BatchRotatingKVCache.merge``; this patch
has order 100, so it is installed first and called by that one: the outer patch replaces zero-length rows
that still hold storage, this one rows that hold none, each with the same zero-length stand-in, so the two
deltas commute and either alone leaves the other's rows to the original.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _rows
from kvpatch.patches._numbers import exact
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="batch-merge-empty",
    summary="BatchKVCache/BatchRotatingKVCache.merge crash when a row's cache is empty (keys None)",
    distribution="mlx-lm",
    affected=">=0.28.4,<0.30.4",
    fixed_in="0.30.4",
    fixed_commit="63c98736",
    reference="ml-explore/mlx-lm#755",
    catalogue="D1",
    order=100,
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-lm < 0.30.4",
        review_by=_dt.date(2027, 6, 1),
    ),
)


def _with_stand_ins(caches: list[Any]) -> list[Any] | None:
    """``caches`` with each empty row replaced by a zero-length copy; ``None`` when no row has keys."""
    import copy

    import mlx.core as mx

    filled = next((c for c in caches if c.keys is not None), None)
    if filled is None:
        return None
    _, heads, _, k_dim = filled.keys.shape
    v_dim = filled.values.shape[3]
    out = []
    for c in caches:
        if c.keys is None:
            c = copy.copy(c)
            c.keys = mx.zeros((1, heads, 0, k_dim), dtype=filled.keys.dtype)
            c.values = mx.zeros((1, heads, 0, v_dim), dtype=filled.values.dtype)
        out.append(c)
    return out


def _build(original: Any) -> Any:
    def merge(cls: Any, caches: Any) -> Any:
        caches = list(caches)
        rows = _with_stand_ins(caches)
        if rows is not None:
            return original(cls, rows)
        fresh = _rows.fresh_batch(cls, caches)
        return original(cls, caches) if fresh is None else fresh

    return merge


PATCH.replace("mlx_lm.models.cache", "BatchKVCache.merge")(_build)
PATCH.replace("mlx_lm.models.cache", "BatchRotatingKVCache.merge")(_build)


_NONE = "'NoneType' object"  # the bug's own errors: the empty row's keys are None


@PATCH.reproduce
def reproduce() -> Finding:
    """Merge a filled and an empty row (both classes) and compare with the per-row contents."""
    import mlx.core as mx
    from mlx_lm.models import cache as C

    mx.random.seed(0)
    k = mx.random.normal((1, 2, 5, 8)).astype(mx.bfloat16)
    v = mx.random.normal((1, 2, 5, 8)).astype(mx.bfloat16)
    problems = []
    for name, batch_cls, make in (
        ("BatchKVCache", C.BatchKVCache, C.KVCache),
        ("BatchRotatingKVCache", C.BatchRotatingKVCache, lambda: C.RotatingKVCache(max_size=8)),
    ):
        for order in ("filled+empty", "empty+filled"):
            filled, empty = make(), make()
            filled.update_and_fetch(k, v)
            rows = [filled, empty] if order == "filled+empty" else [empty, filled]
            try:
                merged = batch_cls.merge(rows)
            except (TypeError, AttributeError) as exc:  # the bug's own errors: the empty row's keys are None
                problems.append(f"{name}.merge({order}) raises {type(exc).__name__}: {symptom(exc, _NONE)}")
                continue
            i = rows.index(filled)
            j = 1 - i
            got = (
                tuple(merged.keys.shape),
                merged.keys.dtype,
                merged.left_padding.tolist(),
                merged.offset.tolist(),
            )
            want_lp = [0, 0]
            want_lp[j] = 5
            want_off = [0, 0]
            want_off[i] = 5
            want = ((2, 2, 5, 8), mx.bfloat16, want_lp, want_off)
            same_keys = exact(merged.keys[i : i + 1], k) and exact(merged.values[i : i + 1], v)
            if got != want or not same_keys:
                problems.append(f"{name}.merge({order}): (shape, dtype, left_padding, offset) {got}, expected {want}")
    if problems:
        return Finding(True, "; ".join(problems))
    return Finding(False, "merging a filled and an empty row gives the filled row's keys and a fully padded empty row")
