"""batch-quantized-extend (catalogue V02): batch quantized ``extend`` drops the rows of the side with no keys yet.

Broken: in mlx-vlm 0.5.0 ``mlx_vlm.models.cache.BatchQuantizedKVCache.extend`` has a shortcut for "one side
has no keys yet" that keeps only the other side's packed ``(weights, scales, biases)`` rows, while
``offset`` and ``left_padding`` are concatenated for both sides. The cache then holds B=1 rows for a batch
of 2 and the next decode step raises ``ValueError: Cannot broadcast array of shape (2,2,1,4) into shape
(1,2,1,4)`` (head dim 32, 4 bits; the last axis is the packed width head_dim*bits/32, so 16 for head dim 64
at 8 bits as in the catalogue), for both ``full.extend(empty)`` and ``empty.extend(full)``.

Measured (Linux, mlx[cpu], mlx-lm 0.31.3): present in mlx-vlm 0.5.0, absent in 0.6.0 and 0.7.10; the class
first appears in 0.5.0 (git b0275383, #1030), 0.4.4 has none. Upstream fix: Blaizzy/mlx-vlm#1248
(654caf4c), released in 0.6.0. The TurboQuant twin (V03, ``empty-tq-rows``) is still unfixed.

Fix: a delta after the original. The original's bookkeeping is right (``_idx`` becomes the longer side's
length, the empty side's ``left_padding`` is raised by it, so all of the empty side's slots are masked);
only its packed rows are missing. When exactly one side was empty and the packed arrays have fewer rows
than the merged batch, zero rows are inserted along the batch axis where the empty side's rows belong (in
front for ``empty.extend(full)``, behind for ``full.extend(empty)``). Zero slots are covered by
``left_padding`` and are overwritten by the next update. When the arrays already have one row per batch
entry (the fixed upstream), nothing is changed. ``extend`` runs once per batch change, not per token.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _reproduce, _rows
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="batch-quantized-extend",
    summary="batch quantized extend() with one empty side keeps only the other side's packed rows",
    distribution="mlx-vlm",
    affected=">=0.5.0,<0.6.0",
    fixed_in="0.6.0",
    fixed_commit="654caf4c",
    introduced_commit="b0275383",
    reference="Blaizzy/mlx-vlm#1248",
    catalogue="V02",
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-vlm < 0.6.0 (and git pins before 654caf4c)",
        review_by=_dt.date(2027, 6, 1),
    ),
)


PATCH.replace("mlx_vlm.models.cache", "BatchQuantizedKVCache.extend")(_rows.filling_rows)


@PATCH.reproduce
def reproduce() -> Finding:
    """Merge a prefilled and an empty batch quantized cache (both orders) and decode (``_rows.check_extend``)."""
    import mlx.core as mx

    try:
        from mlx_vlm.models.cache import BatchQuantizedKVCache
    except ImportError as exc:
        return _reproduce.absent(exc, "this mlx-vlm has no BatchQuantizedKVCache")

    group_size, bits = 32, 4

    def dequantize(cache: Any, qk: Any, qv: Any) -> tuple[Any, Any]:
        return tuple(mx.dequantize(*q, group_size=group_size, bits=bits) for q in (qk, qv))

    return _rows.check_extend(lambda: BatchQuantizedKVCache([0], group_size=group_size, bits=bits), dequantize)
