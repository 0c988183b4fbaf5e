"""rotating-merge-empty (catalogue L-V11): BatchRotatingKVCache.merge crashes on a zero-length row with storage.

Broken: ``mlx_lm.models.cache.BatchRotatingKVCache.merge`` sizes each row's slot by the row's logical
length (``offset``, ``_idx`` or ``size()``, depending on the release) but copies from the row's storage.
A ``RotatingKVCache`` whose logical length is 0 while it still holds a buffer (its state restored or
rebuilt with ``offset = 0``, as prefix caches do, or trimmed back to nothing after it wrapped) hands over
the whole buffer for a zero-length slot; from 0.31.2 the slice ``[..., -0:, :]`` selects the whole buffer
too. Measured on every release with the method, 0.28.4–0.32.2 (0.28.0/0.28.1 have no merge): ``ValueError:
[broadcast_shapes] Shapes (1,2,24,8) and (1,2,0,8) cannot be broadcast`` (24-slot buffer, offset 0), and
``(1,2,8,8) and (1,2,0,8)`` for a wrapped cache (max_size 8, 10 tokens) trimmed by 10. mlx-vlm <= 0.6.3
uses this class; mlx-vlm fixed its own copy in 0.6.14 (Blaizzy/mlx-vlm#1916, dccd29f4, catalogue V11).

Upstream: not reported to ml-explore/mlx-lm; not fixed as of 0.32.2.

Fix: a delta in front of the original. A row whose logical length (``min(offset, max_size)``) is 0 but which
holds keys is replaced, for the merge only, by a shallow copy with zero-length keys/values (same heads,
head dims, dtype) and ``_idx = 0``. The original then copies nothing for it and left-pads it fully, exactly
as it does for a short row; its ``offset`` (0) is kept. The caller's caches are not touched. Merge runs
once per new batch, not per token. (``offset`` is a Python int on single-sequence rotating caches, so
checking it does not synchronise.)

Composition: ``batch-merge-empty`` (order 100) changes the same method on 0.28.4–0.30.2 for rows with no
keys at all; this patch has order 110, so it is installed on top and runs first. The two touch disjoint
rows and produce the same zero-length stand-in, so they commute.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches._numbers import exact
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="rotating-merge-empty",
    summary="BatchRotatingKVCache.merge crashes on a zero-length row that still holds a buffer",
    distribution="mlx-lm",
    affected=">=0.28.4,<=0.32.2",
    checked_through="0.32.2",
    reference="not reported upstream (mlx-vlm's copy: Blaizzy/mlx-vlm#1916)",
    catalogue="L-V11",
    order=110,
    expiry=Expiry(
        "retire when an mlx-lm release skips zero-length rows in BatchRotatingKVCache.merge",
        review_by=_dt.date(2027, 3, 1),
    ),
)


@PATCH.replace("mlx_lm.models.cache", "BatchRotatingKVCache.merge")
def _build(original: Any) -> Any:
    import copy

    def merge(cls: Any, caches: Any) -> Any:
        rows = []
        for c in caches:
            if c.keys is not None and min(c.offset, c.max_size) == 0:
                c = copy.copy(c)
                c.keys = c.keys[..., :0, :]
                c.values = c.values[..., :0, :]
                c._idx = 0
            rows.append(c)
        return original(cls, rows)

    return merge


@PATCH.reproduce
def reproduce() -> Finding:
    """Merge [zero-length row with a 24-slot buffer, filled row]; the merge must equal per-row contents."""
    import mlx.core as mx
    from mlx_lm.models import cache as C

    mx.random.seed(0)
    stale_k = mx.random.normal((1, 2, 24, 8))
    k = mx.random.normal((1, 2, 24, 8))
    v = mx.random.normal((1, 2, 24, 8))
    empty = C.RotatingKVCache(max_size=32)
    empty.keys, empty.values = stale_k, stale_k + 1  # storage left over, logically empty
    empty._idx, empty.offset = 24, 0
    filled = C.RotatingKVCache(max_size=32)
    filled.update_and_fetch(k, v)
    try:
        merged = C.BatchRotatingKVCache.merge([empty, filled])
    except ValueError as exc:  # the bug's own error: the stale storage is sliced to zero length, then broadcast
        detail = symptom(exc, "[broadcast_shapes]")
        return Finding(True, f"merge([zero-length row with storage, filled row]) raises ValueError: {detail}")
    got = (tuple(merged.keys.shape), merged.left_padding.tolist(), merged.offset.tolist())
    want = ((2, 2, 24, 8), [24, 0], [0, 24])
    stale = mx.abs(merged.keys[0]).max().item()
    same = exact(merged.keys[1:], k) and exact(merged.values[1:], v)
    if got != want or not exact(merged.keys[0], mx.zeros_like(merged.keys[0])) or not same:
        return Finding(True, f"(shape, left_padding, offset) {got}, expected {want}; empty row max |key| {stale:.3g}")
    return Finding(False, "the zero-length row merges as a fully padded empty row, the filled row unchanged")
