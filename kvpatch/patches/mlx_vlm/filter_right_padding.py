"""vlm-filter-right-padding (catalogue V10): ``filter()`` during a right-padded prefill keeps the dropped rows' padding.

Broken: a right-padded multi-row prefill declares its padding with ``prepare(right_padding=..., lengths=...)``;
``BatchKVCache`` and ``BatchQuantizedKVCache`` keep it in ``_right_padding`` and ``BatchRotatingKVCache`` in
``_lengths`` until ``finalize()`` rolls it into ``left_padding``. Their ``filter()`` (a request finished or
was cancelled mid-prefill) filters keys, values, ``offset`` and ``left_padding`` but not that pending
state, so ``finalize()`` broadcasts the old batch's padding over the new batch. Measured (Linux,
mlx[cpu]): rows of 4 and 1 tokens padded to 4, ``filter([1])``, ``finalize()``: the one-row cache ends
with ``offset=[4, 1]`` and ``left_padding=[0, 3]`` (reference: the same row prefilled alone, ``offset=[1]``,
``left_padding=[3]``) in all three classes; the next decode then has a two-entry mask for one row.

Measured range: ``mlx_vlm.models.cache.BatchKVCache`` / ``BatchRotatingKVCache`` (mlx-vlm's own copies, from
0.6.4) and ``BatchQuantizedKVCache`` (has ``prepare`` from 0.6.5) in 0.6.4–0.6.13; fixed in 0.6.14
(570afed3). mlx-vlm 0.6.3 and older re-export mlx-lm's classes, whose ``filter`` has the same gap (mlx-lm
0.31.3 measured): that is mlx-lm's bug, not patched here. In 0.6.4 ``BatchQuantizedKVCache`` has no
``prepare`` at all (catalogue V09, patch ``batch-quantized-prepare``); where that patch adds it, it keeps
the same ``_right_padding`` attribute and its own ``filter`` delta, and the two deltas compose (each
indexes the pending padding it saw before the inner call, so the result is the same).

Fix: a delta around the original: read the pending state, run the original ``filter``, then set the
pending state to its rows at ``batch_indices``, the same indices the original applied to ``offset``.
Nothing changes when no padding is pending. ``filter`` runs when the batch changes, not per token.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _pending
from kvpatch.patches._numbers import exact
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="vlm-filter-right-padding",
    summary="batch cache filter() leaves pending right padding (_right_padding/_lengths) unfiltered",
    distribution="mlx-vlm",
    affected=">=0.6.4,<0.6.14",
    fixed_in="0.6.14",
    fixed_commit="570afed3",
    reference="https://github.com/Blaizzy/mlx-vlm/commit/570afed369fd396f7b07b469a5104e1b38bc3310",
    catalogue="V10",
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-vlm < 0.6.14 (and git pins before 570afed3)",
        review_by=_dt.date(2027, 6, 1),
    ),
)


_filter_pending = _pending.filter_pending


PATCH.replace("mlx_vlm.models.cache", "BatchKVCache.filter")(_filter_pending("_right_padding"))
PATCH.replace("mlx_vlm.models.cache", "BatchQuantizedKVCache.filter")(_filter_pending("_right_padding"))
PATCH.replace("mlx_vlm.models.cache", "BatchRotatingKVCache.filter")(_filter_pending("_lengths"))


def _prefill(cls_name: str, keys: Any, rows: list[int], keep: list[int] | None) -> tuple[list, list, Any]:
    """Right-padded prefill of ``keys`` (``rows`` valid tokens each), optionally filtered to ``keep``, then
    finalized. Returns offset, left_padding and the valid keys (dequantized) of the last row."""
    import mlx.core as mx
    from mlx_vlm.models import cache as cache_module

    cls = getattr(cache_module, cls_name)
    if cls_name == "BatchRotatingKVCache":
        cache = cls(16, [0] * len(rows))
    elif cls_name == "BatchQuantizedKVCache":
        cache = cls([0] * len(rows), group_size=32, bits=8)
    else:
        cache = cls([0] * len(rows))
    width = keys.shape[2]
    cache.prepare(right_padding=[width - n for n in rows], lengths=rows)
    cache.update_and_fetch(keys, keys * 2)
    if keep is not None:
        cache.filter(mx.array(keep))
    cache.finalize()
    offset, pad = cache.offset.tolist(), cache.left_padding.tolist()
    stored = cache.keys
    if isinstance(stored, tuple):
        stored = mx.dequantize(*stored, group_size=32, bits=8)
    return offset, pad, stored[-1:, :, pad[-1] : pad[-1] + offset[-1]]


@PATCH.reproduce
def reproduce() -> Finding:
    """Prefill rows of 4 and 1 tokens right-padded, drop the first row before ``finalize()``, and compare the
    one-row cache with that row prefilled alone: offset, left padding and the valid keys."""
    import mlx.core as mx
    from mlx_vlm.models import cache as cache_module

    mx.random.seed(0)
    keys = mx.random.normal((2, 2, 4, 32))
    problems, checked = [], []
    for cls_name in ("BatchKVCache", "BatchRotatingKVCache", "BatchQuantizedKVCache"):
        cls = getattr(cache_module, cls_name, None)
        if cls is None or not hasattr(cls, "prepare"):
            continue
        checked.append(cls_name)
        try:
            offset, pad, valid = _prefill(cls_name, keys, [4, 1], [1])
            ref_offset, ref_pad, ref_valid = _prefill(cls_name, keys[1:], [1], None)
        except (ValueError, IndexError) as exc:  # the filtered row's stale padding misaligns the slices
            problems.append(f"{cls_name}: raises {type(exc).__name__}: {symptom(exc, '[broadcast_shapes]', 'Cannot')}")
            continue
        if offset != ref_offset or pad != ref_pad:
            problems.append(
                f"{cls_name}: after filter+finalize offset={offset} left_padding={pad}, "
                f"the row prefilled alone offset={ref_offset} left_padding={ref_pad}"
            )
        elif not exact(valid, ref_valid):
            problems.append(f"{cls_name}: valid keys differ from the row prefilled alone")
    if not checked:
        return Finding(False, "no batch cache here has prepare(): nothing to fix")
    if problems:
        return Finding(True, "; ".join(problems))
    return Finding(False, f"{', '.join(checked)}: after filter+finalize equal to the row prefilled alone")
