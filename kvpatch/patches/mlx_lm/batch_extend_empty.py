"""batch-extend-empty (catalogue D2+F1): extending a batch cache with (or into) an empty one breaks.

Broken: ``BatchKVCache.extend`` / ``BatchRotatingKVCache.extend`` join two batch caches (the running batch
and newly prefilled prompts). When one side has no keys yet (e.g. a batch of one-token prompts, which
need no prefill) it goes wrong in three release-dependent ways, measured with a 2-row bf16 cache and a
1-row empty one (``full.extend(empty)`` and ``empty.extend(full)``):

* 0.28.0–0.31.1: ``AttributeError: 'NoneType' object has no attribute 'shape'`` (both classes; both
  sides empty too);
* 0.31.2: keys of 4 rows for 3 rows of ``offset``/``left_padding`` (the empty side is padded with the
  other side's batch size), and the keys come back float32;
* 0.31.3: the right batch size, but a bf16 cache comes back float32 (twice the memory, and the next
  ``update_and_fetch`` writes bf16 into a float32 buffer).

Upstream: ml-explore/mlx-lm#1141 (62f38aeb, batch size, in 0.31.3) and ml-explore/mlx-lm#1491 (dtype), both
in 0.32.0 (measured clean on 0.32.0 and 0.32.2; 0.31.3 still has the dtype half). The dtype fix is not
on the public main line (its PR commit aaafac06 is unmerged there, and public main at 0.32.0 still lacks
it), so no ``fixed_commit`` is given: a git pin cannot be placed against it.
``BatchRotatingKVCache.extend`` first exists in 0.28.1 (optional target).

Fix: a delta in front of the original. An empty side gets zero-length keys and values shaped from the
other side: its own batch size (``offset`` has one entry per row), the other side's head count and head
dims and, crucially, its dtype. The original then left-pads it to the common length like any short
cache, so the result has every row, the caller's dtype and the empty rows fully left-padded (they see
only tokens that come after the join). ``other`` is copied before it gets stand-in keys, so the caller's
object is not modified; ``self`` is extended in place, as upstream does. Both sides empty: only
``offset`` and ``left_padding`` are joined (what 0.31.2+ do). Extend runs once per batch join.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _rows
from kvpatch.patches._numbers import judge
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="batch-extend-empty",
    summary="BatchKVCache/BatchRotatingKVCache.extend with an empty side: crash, wrong batch size or bf16 -> float32",
    distribution="mlx-lm",
    affected=">=0.28.0,<0.32.0",
    fixed_in="0.32.0",
    reference="ml-explore/mlx-lm#1141",
    catalogue="D2+F1",
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-lm < 0.32.0",
        review_by=_dt.date(2027, 6, 1),
    ),
)


def _build(original: Any) -> Any:
    import mlx.core as mx

    def extend(self: Any, other: Any) -> Any:
        if self.keys is None and other.keys is None:
            self.offset = mx.concatenate([self.offset, other.offset])
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            return None
        return original(self, _rows.stand_in_empty_side(self, other))

    return extend


PATCH.replace("mlx_lm.models.cache", "BatchKVCache.extend")(_build)
PATCH.replace("mlx_lm.models.cache", "BatchRotatingKVCache.extend", optional=True)(_build)


@PATCH.reproduce
def reproduce() -> Finding:
    """Join a 2-row bf16 cache and an empty 1-row cache both ways; check rows, dtype and attention numbers
    (``_rows.check_join``)."""
    import mlx.core as mx
    from mlx_lm.models import cache as C

    makers = [("BatchKVCache", lambda n: C.BatchKVCache([0] * n))]
    if hasattr(getattr(C, "BatchRotatingKVCache", None), "extend"):
        makers.append(("BatchRotatingKVCache", lambda n: C.BatchRotatingKVCache(16, [0] * n)))
    problems, found = _rows.check_join(makers, [mx.bfloat16])
    return judge(
        found,
        "per-row attention differs from each row alone after the join",
        "joins with an empty side keep every row, stay bfloat16 and attend like each row alone",
        problems=problems,
    )
