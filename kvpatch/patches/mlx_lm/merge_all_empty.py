"""merge-all-empty: merging batch caches from rows that are all still empty raises.

Broken: in mlx-lm 0.30.4–0.31.1 ``BatchKVCache.merge`` and ``BatchRotatingKVCache.merge`` take the head count
and dtype from the rows that have keys; when no row has any, they raise ``ValueError: max() arg is an empty
sequence``, and ``ArraysCache.merge`` raises ``StopIteration`` (measured on 0.30.4, 0.30.7, 0.31.1; 0.31.2
returns a fresh empty batch cache of each kind, 3f9d179f, #1072). 0.30.4 fixed merging *one* empty row
(63c98736, #755: ``batch-merge-empty``, which on 0.28.4–0.30.2 also handles the all-empty case).

Reach: upstream's own ``BatchGenerator`` in these releases sends a batch whose first layer is empty in every
row to fresh caches instead of merging, so it does not get here; code that merges per-request caches
itself (downstream servers, a batch of new requests) does, and gets the exception.

Fix: a delta in front of each original: when every row is empty, return what 0.31.2 returns (a new empty
batch cache for that many rows, no padding; for the rotating cache with the rows' common ``max_size``, and
upstream's own error when the sizes differ). Any other input goes to the original unchanged. Merge runs
once per new batch, not per token.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _rows
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="merge-all-empty",
    summary="BatchKVCache/BatchRotatingKVCache/ArraysCache.merge raise when every row is empty",
    distribution="mlx-lm",
    affected=">=0.30.4,<0.31.2",
    fixed_in="0.31.2",
    fixed_commit="3f9d179f",
    catalogue="N11 (all-empty merge)",
    reference="ml-explore/mlx-lm#1072",
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-lm < 0.31.2",
        review_by=_dt.date(2027, 6, 1),
    ),
)


@PATCH.replace("mlx_lm.models.cache", "BatchRotatingKVCache.merge")
@PATCH.replace("mlx_lm.models.cache", "BatchKVCache.merge")
def _build_kv(original: Any) -> Any:
    def merge(cls: Any, caches: Any) -> Any:
        caches = list(caches)
        if caches and all(c.keys is None for c in caches):
            fresh = _rows.fresh_batch(cls, caches)
            if fresh is not None:
                return fresh
        return original(cls, caches)

    return merge


@PATCH.replace("mlx_lm.models.cache", "ArraysCache.merge")
def _build_arrays(original: Any) -> Any:
    def merge(cls: Any, caches: Any) -> Any:
        caches = list(caches)
        if caches and all(c.empty() for c in caches):
            return cls(len(caches[0].cache))
        return original(cls, caches)

    return merge


@PATCH.reproduce
def reproduce() -> Finding:
    """Merge two empty rows of each kind; the KV batches must then take a 3-token update for both rows."""
    import mlx.core as mx
    from mlx_lm.models import cache as C

    kinds = [
        ("BatchKVCache", C.BatchKVCache, C.KVCache),
        ("BatchRotatingKVCache", C.BatchRotatingKVCache, lambda: C.RotatingKVCache(max_size=8)),
    ]
    if hasattr(C.ArraysCache, "merge"):
        kinds.append(("ArraysCache", C.ArraysCache, lambda: C.ArraysCache(size=2)))
    problems, notes = [], []
    kv = mx.random.normal((2, 2, 3, 4), key=mx.random.key(0))
    for name, batch_cls, make in kinds:
        try:
            merged = batch_cls.merge([make(), make()])
        except ValueError as exc:
            if "empty sequence" not in str(exc):
                raise
            problems.append(f"{name}.merge([empty, empty]) raises ValueError: {exc}")
            continue
        except StopIteration:
            problems.append(f"{name}.merge([empty, empty]) raises StopIteration")
            continue
        if name == "ArraysCache":
            notes.append(f"{name}: empty merged cache")
            continue
        k, _ = merged.update_and_fetch(kv, kv + 1)
        got = (tuple(k.shape), merged.offset.tolist())
        if got != ((2, 2, 3, 4), [3, 3]):
            problems.append(f"{name}: after a 3-token update (keys shape, offset) {got}, not ((2, 2, 3, 4), [3, 3])")
        notes.append(f"{name}: {got}")
    if problems:
        return Finding(True, "; ".join(problems))
    return Finding(False, "; ".join(notes))
