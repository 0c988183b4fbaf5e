"""pooling-mask-offset: mlx-vlm's ``BatchPoolingCache.make_mask`` adds an integer offset twice.

Broken: ``mlx_vlm.models.cache.BatchPoolingCache`` (DeepSeek-V4's compressed attention in a batch, 0.6.0+, git
72b97db4, Blaizzy/mlx-vlm#1223) builds its prefill mask from the query positions ``offset + 1 .. offset + L``
(query ``j`` may see pooled entry ``i`` iff ``i < position // ratio``, as ``PoolingCache.make_mask`` does). With a
per-row ``mx.array`` offset it computes them right; with a Python ``int`` offset it computes
``offset + arange(offset + 1, offset + L + 1)``, positions shifted by ``offset``: from the second prefill chunk on
every query also sees the pooled entries of later tokens of its chunk (the mask is all-True where it must be causal).
An int offset reaches it from callers that pass one (``position_offset``: mlx-vlm's DeepSeek-V4 MTP drafter passes
its ``_next_position``; servers that drive the model). Decode (``L == 1``) does not read the offset: not affected.
Measured (Linux, mlx[cpu]; ratio 4, one row, a 16-token chunk then an 8-token chunk at offset 16): the int offset's
mask lets all 8 queries see all 6 pooled entries, where the array offset's (and the rule's) see 4, 4, 4, 5, 5, 5, 5
and 6; present in every bucket that has the class (0.6.0 through 0.7.10). Rapid-MLX fixes its vendored copy.

Upstream: not fixed as of 0.7.10, not reported (the line is upstream's ``BatchPoolingCache.make_mask``, the
``else`` branch of ``isinstance(offset, mx.array)``).

Fix: a delta in front of the original: an integer offset with ``L > 1`` is handed on as a one-element array
(``mx.array([offset])``), so upstream's own array branch computes the positions (the same ``(1, L, P)`` causal part
broadcast against the rows' lengths as before, no host synchronisation). Arrays and decode calls go to the original
as they are. ``make_mask`` runs per pooled layer per forward pass: the replacement is a plain function, decided at
install.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _reproduce
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="pooling-mask-offset",
    summary="BatchPoolingCache.make_mask adds an int offset twice: prefill queries see later pooled entries",
    distribution="mlx-vlm",
    affected=">=0.6.0,<=0.7.10",
    checked_through="0.7.10",
    introduced_commit="72b97db4",
    reference="not reported upstream (mlx_vlm/models/cache.py, BatchPoolingCache.make_mask, the int-offset branch)",
    catalogue="issue 29 item 5",
    hot_path=True,
    expiry=Expiry(
        "retire when mlx-vlm's BatchPoolingCache.make_mask computes int-offset positions as PoolingCache does",
        review_by=_dt.date(2027, 3, 1),
    ),
)


@PATCH.replace("mlx_vlm.models.cache", "BatchPoolingCache.make_mask")
def _build(original: Any) -> Any:
    import mlx.core as mx

    array = mx.array

    def make_mask(self: Any, L: int = 1, offset: Any = 0) -> Any:
        if L > 1 and not isinstance(offset, array):
            offset = array([offset])
        return original(self, L, offset)

    return make_mask


def chunked_masks(cls: Any, ratio: int = 4, first: int = 16, second: int = 8) -> tuple[Any, Any, list[list[bool]]]:
    """A one-row batch pooling cache fed a ``first``-token chunk then a ``second``-token chunk (the pooled entries
    those complete); returns the second chunk's mask with an int offset, with an array offset, and the rule's."""
    import mlx.core as mx

    cache = cls(ratio, [0])
    D = 8
    pooled = 0
    for start, n in ((0, first), (first, second)):
        kv = mx.random.normal((1, n, D), key=mx.random.key(start))
        cache.accumulate_windows(kv, kv, start)
        pooled = (start + n) // ratio
        cache.update_and_fetch(mx.ones((1, pooled - cache.size(), D)))
    as_int = cache.make_mask(second, first)
    as_array = cache.make_mask(second, mx.array([first]))
    rule = [[i < (first + j) // ratio for i in range(pooled)] for j in range(1, second + 1)]
    return as_int, as_array, rule


@PATCH.reproduce
def reproduce() -> Finding:
    """The second prefill chunk's mask with an int offset against the rule (and the array offset's mask)."""
    try:
        from mlx_vlm.models.cache import BatchPoolingCache
    except ImportError as exc:
        return _reproduce.absent(exc, "this mlx-vlm has no BatchPoolingCache")
    as_int, as_array, rule = chunked_masks(BatchPoolingCache)
    got = as_int.reshape(len(rule), -1).tolist()
    counts = [sum(row) for row in got]
    want = [sum(row) for row in rule]
    if as_array.reshape(len(rule), -1).tolist() != rule:
        return Finding(False, inconclusive=f"the array offset's mask does not follow the rule either: {as_array}")
    if got != rule:
        return Finding(
            True, f"int offset 16, 8 queries: pooled entries visible per query {counts}, expected {want} (future leak)"
        )
    return Finding(False, f"int offset 16, 8 queries: pooled entries visible per query {counts}, as expected")
