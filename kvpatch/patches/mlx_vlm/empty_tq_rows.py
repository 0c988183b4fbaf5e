"""empty-tq-rows (catalogue V03): batch TurboQuant ``extend`` drops the rows of the side with no keys yet.

Broken: ``mlx_vlm.turboquant.BatchTurboQuantKVCache.extend`` has a shortcut for "one side has no keys
yet" that keeps only the other side's packed key/value rows, while ``offset`` and ``left_padding`` are
concatenated for both sides. The cache then holds B=1 packed rows for a batch of 2, and the next decode
step raises ``ValueError: Cannot broadcast array of shape (2,2,1) into shape (1,2,1)`` when it writes the
new token. Both orders fail: ``full.extend(empty)`` and ``empty.extend(full)``. In ``empty.extend(full)``
the merged cache also keeps no codec of its own (it builds a fresh one on the next update) although its
packed rows were encoded by the other side's codec.

Measured (Linux, mlx[cpu]): present in mlx-vlm 0.5.0, 0.6.0, 0.6.4, 0.7.8 and 0.7.10 (the class first
appears in 0.5.0, git b0275383 / #1030; 0.4.4 has no BatchTurboQuantKVCache). Not fixed upstream as of
0.7.10; not reported upstream. The uniform quantized twin (V02, ``batch-quantized-extend``) was fixed in
0.6.0 by Blaizzy/mlx-vlm#1248.

Fix: a delta after the original. The original's bookkeeping is right (``_idx`` becomes the longer
side's length, the empty side's ``left_padding`` is raised by it, so all of the empty side's slots are
masked); only its packed rows are missing. When exactly one side was empty and the packed state has
fewer rows than the merged batch, zero rows are inserted along the batch axis where the empty side's
rows belong (in front for ``empty.extend(full)``, behind for ``full.extend(empty)``), in every array of
the (possibly nested) state; and a cache that had no codec adopts the codec that encoded the rows it now
holds. Zero slots are covered by ``left_padding`` and are overwritten by the next update. When the
state already has one row per batch entry (a fixed upstream), nothing is changed. ``extend`` runs once
per batch change, not per token.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _reproduce, _rows
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="empty-tq-rows",
    summary="batch TurboQuant extend() with one empty side keeps only the other side's packed rows",
    distribution="mlx-vlm",
    affected=">=0.5.0,<=0.7.10",
    introduced_commit="b0275383",
    checked_through="0.7.10",
    reference="not reported upstream",
    catalogue="V03",
    expiry=Expiry(
        "retire when mlx-vlm's BatchTurboQuantKVCache.extend keeps one packed row per batch entry "
        "when one side is empty (the reproduction then finds the bug absent)",
        review_by=_dt.date(2027, 3, 1),
    ),
)


@PATCH.replace("mlx_vlm.turboquant", "BatchTurboQuantKVCache.extend")
def _build(original: Any) -> Any:
    extend_rows = _rows.filling_rows(original)

    def extend(self: Any, other: Any) -> Any:
        adopts = self.keys is None and other.keys is not None
        result = extend_rows(self, other)
        if adopts and self.keys is not None and self.key_codec is None:
            self.key_codec = other.key_codec
            self.value_codec = other.value_codec
        return result

    return extend


@PATCH.reproduce
def reproduce() -> Finding:
    """Merge a prefilled and an empty batch TurboQuant cache (both orders) and decode (``_rows.check_extend``)."""
    try:
        from mlx_vlm.turboquant import BatchTurboQuantKVCache
    except ImportError as exc:
        return _reproduce.absent(exc, "this mlx-vlm has no BatchTurboQuantKVCache")

    return _rows.check_extend(
        lambda: BatchTurboQuantKVCache([0], bits=4), lambda cache, ks, vs: cache.dequantize(ks, vs)
    )
