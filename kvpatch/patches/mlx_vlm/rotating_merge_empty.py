"""vlm-rotating-merge-empty (catalogue V11): merging a zero-length rotating cache that still has storage crashes.

Broken: ``mlx_vlm.models.cache.BatchRotatingKVCache.merge`` copies each row's last ``length`` positions with
``c._temporal_order(c.keys)[..., -length:, :]``. For a row whose ``size()`` is 0 but whose key buffer is
still allocated (an APC / prompt-cache restore with ``offset=0``, or any ``RotatingKVCache`` whose
``offset`` was rewound while ``_idx`` kept the buffer length), ``-0:`` selects the whole buffer, and
assigning it into the row's zero-width slot raises. Measured (Linux, mlx[cpu]): a 24-token row merged
with a ``RotatingKVCache(max_size=32)`` holding a 24-slot buffer at ``offset=0, _idx=24`` raises
``ValueError: [broadcast_shapes] Shapes (1,2,24,4) and (1,2,0,4) cannot be broadcast`` in either order, in
mlx-vlm 0.6.4 and 0.6.13; 0.6.14 merges it (Blaizzy/mlx-vlm#1916, dccd29f4). mlx-vlm 0.6.3 and older
re-export mlx-lm's class, which has the same crash (catalogue L-V11, an mlx-lm patch).

Fix: a delta in front of the original. Rows that are logically empty (``size() == 0``) but hold storage
are handed to the original as shallow copies with ``keys``/``values`` set to ``None``, which is the state
the original already handles (a fully padded row of zeros); the caller's cache objects are not
modified. Rows with content are passed as they are. ``merge`` runs when a batch is assembled, not per
token.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches._numbers import difference, judge, worst
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="vlm-rotating-merge-empty",
    summary="BatchRotatingKVCache.merge slices [-0:] (the whole buffer) for a zero-length row with storage",
    distribution="mlx-vlm",
    affected=">=0.6.4,<0.6.14",
    fixed_in="0.6.14",
    fixed_commit="dccd29f4",
    reference="Blaizzy/mlx-vlm#1916",
    catalogue="V11",
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-vlm < 0.6.14 (and git pins before dccd29f4)",
        review_by=_dt.date(2027, 6, 1),
    ),
)


@PATCH.replace("mlx_vlm.models.cache", "BatchRotatingKVCache.merge")
def _build(original: Any) -> Any:
    import copy

    def hollow(cache: Any) -> Any:
        if getattr(cache, "keys", None) is None or cache.size() != 0:
            return cache
        stand_in = copy.copy(cache)
        stand_in.keys = None
        stand_in.values = None
        return stand_in

    def merge(cls: Any, caches: Any) -> Any:
        return original(cls, [hollow(c) for c in caches])

    return merge


def _empty_with_storage(heads: int, slots: int, dim: int, max_size: int) -> Any:
    """A RotatingKVCache restored the way prompt-cache loading does (state + meta_state) with offset 0."""
    import mlx.core as mx
    from mlx_vlm.models.cache import RotatingKVCache

    cache = RotatingKVCache(max_size=max_size)
    cache.state = (mx.ones((1, heads, slots, dim)), mx.ones((1, heads, slots, dim)))
    cache.meta_state = ("0", str(max_size), "0", str(slots))
    return cache


@PATCH.reproduce
def reproduce() -> Finding:
    """Merge a 24-token row and an empty row with a 24-slot buffer (both orders), decode one token through
    the merged cache, and compare each row's attention output with the row decoded in a cache of its own."""
    import mlx.core as mx
    from mlx_vlm.models.cache import BatchRotatingKVCache, RotatingKVCache

    mx.random.seed(0)
    heads, dim, length, max_size = 2, 4, 24, 32
    prompt_k, prompt_v = mx.random.normal((1, heads, length, dim)), mx.random.normal((1, heads, length, dim))
    step_k, step_v = mx.random.normal((2, heads, 1, dim)), mx.random.normal((2, heads, 1, dim))
    queries = mx.random.normal((2, heads, 1, dim))

    def full() -> Any:
        cache = RotatingKVCache(max_size=max_size)
        cache.update_and_fetch(prompt_k, prompt_v)
        return cache

    def attend(cache: Any, rows: slice) -> Any:
        mask = cache.make_mask(1, return_array=True) if isinstance(cache, BatchRotatingKVCache) else None
        k, v = cache.update_and_fetch(step_k[rows], step_v[rows])
        return mx.fast.scaled_dot_product_attention(queries[rows], k, v, scale=dim**-0.5, mask=mask)

    problems, found = [], []
    for order in ("empty, full", "full, empty"):
        rows = [_empty_with_storage(heads, length, dim, max_size), full()]
        if order.startswith("full"):
            rows.reverse()
        try:
            merged = BatchRotatingKVCache.merge(rows)
            out = attend(merged, slice(0, 2))
            mx.eval(out)
        except ValueError as exc:  # the bug's own error: the empty row's storage sliced to zero, then broadcast
            problems.append(f"merge({order}) raises ValueError: {symptom(exc, '[broadcast_shapes]')}")
            continue
        for i, name in enumerate(order.split(", ")):
            alone = full() if name == "full" else RotatingKVCache(max_size=max_size)
            ref = attend(alone, slice(i, i + 1))
            found.append(difference(out[i : i + 1], ref, where=f"merge({order}), the {name} row"))
    return judge(
        worst(found),
        "merged decode differs from per-row decode",
        "both orders merge; merged decode equals per-row decode",
        problems=problems,
    )
