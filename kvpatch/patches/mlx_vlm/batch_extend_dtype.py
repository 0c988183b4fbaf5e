"""vlm-batch-extend-dtype (catalogue D2+F1, mlx-vlm's copy): an empty-side batch join turns bf16/fp16 to float32.

Broken: mlx-vlm's own ``mlx_vlm.models.cache.BatchKVCache.extend`` and ``BatchRotatingKVCache.extend`` (its
copies of mlx-lm's classes, from 0.6.4, commit a492e47d) give the side that has no keys yet (a row joining
with an empty cache, e.g. a one-token prompt that needs no prefill) zero-length placeholders built with
``mx.array([])``, which is float32; the concatenation then promotes the whole joined batch to float32.
Measured (Linux, mlx[cpu]) with a 2-row cache and an empty 1-row cache, ``full.extend(empty)`` and
``empty.extend(full)``, both classes: bfloat16 and float16 keys come back float32 (3 rows, right batch
size, right numbers) on every release of 0.6.4, 0.6.5, 0.6.13, 0.6.14, 0.6.16, 0.7.0, 0.7.6, 0.7.8 and
0.7.10. Twice the KV memory, and the row's next ``update_and_fetch`` writes into a float32 buffer, so a
request's numbers depend on whether another one joined its batch. It is the dtype half of mlx-lm's D2+F1
(ml-explore/mlx-lm#1491, fixed in mlx-lm 0.32.0), never carried over to mlx-vlm's copy; not reported to
mlx-vlm. mlx-vlm 0.6.3 and older re-export mlx-lm's classes (same bug with mlx-lm < 0.32.0), which the
mlx-lm patch ``batch-extend-empty`` fixes: out of this patch's range.

Fix: a delta in front of the original. When exactly one side has no keys, it gets zero-length keys and
values of its own row count with the other side's head count, head dims and dtype, instead of upstream's
float32 placeholders; the original then pads and joins exactly as before, so offsets, padding and
numbers are unchanged and only the dtype differs (the one a batch of that dtype should hold). ``other``
is a shallow copy before it gets them, so the caller's cache object is not modified; ``self`` is extended
in place as upstream does (and keeps ``keys=None`` if the original raises). Both sides empty, or both
full: the original runs untouched. ``extend`` runs once per batch join, not per token.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _rows
from kvpatch.patches._numbers import judge
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="vlm-batch-extend-dtype",
    summary="mlx-vlm BatchKVCache/BatchRotatingKVCache.extend with an empty side turns a bf16/fp16 batch float32",
    distribution="mlx-vlm",
    affected=">=0.6.4,<=0.7.10",
    checked_through="0.7.10",
    introduced_commit="a492e47d",
    reference="not reported upstream",
    catalogue="D2+F1 (mlx-vlm's copy)",
    expiry=Expiry(
        "retire when mlx-vlm's own extend builds the empty side's placeholders in the other side's dtype",
        review_by=_dt.date(2027, 3, 1),
    ),
)


def _build(original: Any) -> Any:
    def extend(self: Any, other: Any) -> Any:
        if (self.keys is None) == (other.keys is None):
            return original(self, other)
        if self.keys is not None:
            return original(self, _rows.stand_in_empty_side(self, other))
        _rows.stand_in_empty_side(self, other)
        try:
            return original(self, other)
        except BaseException:
            if self.keys is not None and self.keys.shape[2] == 0:
                self.keys = self.values = None
            raise

    return extend


PATCH.replace("mlx_vlm.models.cache", "BatchKVCache.extend")(_build)
PATCH.replace("mlx_vlm.models.cache", "BatchRotatingKVCache.extend")(_build)


@PATCH.reproduce
def reproduce() -> Finding:
    """Join a 2-row cache and an empty 1-row cache both ways, in bfloat16 and float16, with both classes
    (``_rows.check_join``)."""
    import mlx.core as mx
    from mlx_vlm.models import cache as C

    if not C.BatchKVCache.__module__.startswith("mlx_vlm."):
        return Finding(
            False,
            "mlx-vlm re-exports mlx-lm's BatchKVCache here",
            skipped="mlx-vlm < 0.6.4 has no batch caches of its own (mlx-lm's are covered by batch-extend-empty)",
        )
    makers = [
        ("BatchKVCache", lambda n: C.BatchKVCache([0] * n)),
        ("BatchRotatingKVCache", lambda n: C.BatchRotatingKVCache(16, [0] * n)),
    ]
    problems, found = _rows.check_join(makers, [mx.bfloat16, mx.float16])
    return judge(
        found,
        "per-row attention differs from each row alone after the join",
        "bfloat16/float16 joins with an empty side keep their dtype and attend like each row alone",
        problems=problems,
    )
