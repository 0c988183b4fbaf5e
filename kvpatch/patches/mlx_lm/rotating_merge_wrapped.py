"""rotating-merge-wrapped: BatchRotatingKVCache.merge crashes on a RotatingKVCache that went past its window.

Broken: ``mlx_lm.models.cache.BatchRotatingKVCache.merge`` sizes each row's slot by its logical length
(``min(offset, max_size)``) but copies ``c._temporal_order(c.keys)`` into ``[p : p + width]`` with a width
that is not that length: ``c.offset`` in 0.28.4–0.30.2, ``c._idx`` from 0.30.4 (509f5aef, #738) to 0.31.1.
Two states of a single-sequence ``RotatingKVCache`` that a server meets after a conversation outgrew
``max_kv_size`` then fail to merge (measured: window 8, 11 tokens, merged with a 5-token row):

* wrapped by decode steps (the ring's write index ``_idx=3``, buffer 8): ``ValueError: [broadcast_shapes]
  Shapes (1,2,8,4) and (1,2,3,4)`` on 0.30.4, 0.30.7 and 0.31.1 (introduced by 509f5aef; 0.28.4 and 0.30.2
  merge it correctly, error 6e-08);
* over-full after a multi-token update (a prompt longer than the window leaves ``max_size + S - 1`` = 11
  slots, ``_idx=11``; what a prefilled prompt cache holds): ``Shapes (1,2,11,4) and (1,2,8,4)`` on 0.28.4,
  0.30.2, 0.30.4, 0.30.7 and 0.31.1.

0.31.2 merges both (3f9d179f, #1072: slot width = logical length, copy the last that many positions);
merged-then-decoded attention equals each row decoded alone to 6e-08 there. mlx-vlm's own copy
(0.6.4+, taken from the fixed code) merges both correctly on 0.6.4, 0.6.13, 0.6.14 and 0.7.10; mlx-vlm
before 0.6.4 pairs with mlx-lm >= 0.31.3. No mlx-vlm twin is needed.

Fix: a delta in front of the original. Each row whose storage is not already ``size()`` positions in
temporal order is handed to the original as a shallow copy holding exactly its last ``size()`` positions
in temporal order (taken with the row's own ``_temporal_order``) and ``_idx = size()``; ``offset`` is
kept. Every slot width the original may use then equals the row's length (for ``offset`` the slice stops
at the end of the buffer: the row is the longest, at ``size() = max_size``). The caller's caches are not
modified. Rows without keys or of length 0 are left to ``batch-merge-empty`` / ``rotating-merge-empty``.
Merge runs once per new batch, not per token.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches._numbers import difference, judge, worst
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="rotating-merge-wrapped",
    summary="BatchRotatingKVCache.merge crashes on a RotatingKVCache that wrapped or overfilled its window",
    distribution="mlx-lm",
    affected=">=0.28.4,<0.31.2",
    fixed_in="0.31.2",
    fixed_commit="3f9d179f",
    catalogue="N10 (merge of a wrapped RotatingKVCache)",
    reference="ml-explore/mlx-lm#1072",
    order=120,
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-lm < 0.31.2",
        review_by=_dt.date(2027, 6, 1),
    ),
)


def _in_order(cache: Any) -> Any:
    """``cache``, or a shallow copy holding its last ``size()`` positions in temporal order."""
    import copy

    if cache.keys is None:
        return cache
    length = min(cache.offset, cache.max_size)
    if length == 0 or (cache.keys.shape[2] == length and cache._idx == length):
        return cache
    stand_in = copy.copy(cache)
    stand_in.keys = cache._temporal_order(cache.keys)[..., -length:, :]
    stand_in.values = cache._temporal_order(cache.values)[..., -length:, :]
    stand_in._idx = length
    return stand_in


@PATCH.replace("mlx_lm.models.cache", "BatchRotatingKVCache.merge")
def _build(original: Any) -> Any:
    def merge(cls: Any, caches: Any) -> Any:
        return original(cls, [_in_order(c) for c in caches])

    return merge


def rows(max_size: int = 8, heads: int = 2, dim: int = 4) -> dict[str, Any]:
    """Factories for single-sequence rotating caches: wrapped by decode, over-full after one chunk, short."""
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    def tokens(n: int, seed: int) -> Any:
        return mx.random.normal((1, heads, n, dim), key=mx.random.key(seed))

    def wrapped_by_decode() -> Any:
        c = RotatingKVCache(max_size=max_size)
        c.update_and_fetch(tokens(5, 1), tokens(5, 2))
        for i in range(6):
            c.update_and_fetch(tokens(1, 10 + i), tokens(1, 20 + i))
        return c

    def overfull() -> Any:
        c = RotatingKVCache(max_size=max_size)
        c.update_and_fetch(tokens(11, 3), tokens(11, 4))
        return c

    def short() -> Any:
        c = RotatingKVCache(max_size=max_size)
        c.update_and_fetch(tokens(5, 5), tokens(5, 6))
        return c

    return {"wrapped by decode": wrapped_by_decode, "over-full after one chunk": overfull, "short": short}


@PATCH.reproduce
def reproduce() -> Finding:
    """Merge each past-the-window row with a short row, decode one token, compare with each row alone."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchRotatingKVCache

    heads, dim = 2, 4
    make = rows(heads=heads, dim=dim)
    queries = mx.random.normal((2, heads, 1, dim), key=mx.random.key(99))
    step = mx.random.normal((2, heads, 1, dim), key=mx.random.key(98))

    def attend(cache: Any, rows_: slice) -> Any:
        mask = cache.make_mask(1, return_array=True) if isinstance(cache, BatchRotatingKVCache) else None
        k, v = cache.update_and_fetch(step[rows_], step[rows_] + 1)
        return mx.fast.scaled_dot_product_attention(queries[rows_], k, v, scale=dim**-0.5, mask=mask)

    problems, found = [], []
    for name in ("wrapped by decode", "over-full after one chunk"):
        c = make[name]()
        state = f"offset={c.offset} _idx={c._idx} buffer={c.keys.shape[2]}"
        try:
            merged = BatchRotatingKVCache.merge([make[name](), make["short"]()])
        except ValueError as exc:
            if "broadcast" not in str(exc):
                raise
            problems.append(f"{name} ({state}): merge raises ValueError: {exc}")
            continue
        out = attend(merged, slice(0, 2))
        found.append(difference(out[0:1], attend(make[name](), slice(0, 1)), where=f"{name} ({state}), its row"))
        found.append(difference(out[1:2], attend(make["short"](), slice(1, 2)), where=f"{name}, the short row"))
    return judge(
        worst(found),
        "merged decode differs from each row alone",
        "both past-the-window rows merge and decode like each row alone",
        problems=problems,
    )
