"""tq-prefix-snapshot (catalogue V31): the batch TurboQuant cache cannot be snapshotted for the prefix cache.

Broken: from mlx-vlm 0.7.0 both TurboQuant caches share ``_TurboQuantAttentionMixin``, whose packed
prefix-cache contract (``prefix_cache_snapshot`` / ``prefix_cache_restore`` / ``prefix_cache_reserve``)
is written for the single-row cache's integer ``offset``. ``BatchTurboQuantKVCache`` inherits all three:

* ``prefix_cache_snapshot()`` slices the packed state with the per-row ``offset`` array:
  ``ValueError: Slice indices must be integers or None.`` (also for a single unpadded row), so the APC
  disk store (``_snapshot_exact_cache_entry``) rejects every batch TurboQuant layer;
* ``prefix_cache_restore(snapshot)`` re-initialises with ``self.__init__(bits=...)``, which the batch
  class cannot take: ``TypeError: BatchTurboQuantKVCache.__init__() missing 1 required positional
  argument: 'left_padding'``;
* ``prefix_cache_reserve(n)`` (called right after a restore) passes the offset array as the used length:
  ``ValueError: [convert] Only length-1 arrays can be converted to Python scalars.``

Measured (Linux, mlx[cpu]): present in 0.7.0, 0.7.6, 0.7.8 and 0.7.10; in 0.6.17 (the lower edge) the
batch class still inherits the generic ``state``/``meta_state`` snapshot of ``_BaseCache`` and the
snapshot works. Not fixed upstream as of 0.7.10; not reported upstream; the 0.7.x mixin has no public
commit.

Fix: the three methods are replaced on ``BatchTurboQuantKVCache`` only (the engine sets them on the
batch class and deletes them again on removal); ``TurboQuantKVCache`` keeps the mixin's. Each is a delta
that runs the mixin's own code on the right inputs:

* snapshot: the original runs on a read-only view of the cache whose ``offset`` is the batch's integer
  write index ``_idx`` (the number of packed slots every row has), so it slices and snapshots the codecs
  exactly as for a single row; the batch's per-row ``offset`` and ``left_padding`` arrays are added to
  the snapshot (plain arrays, which the APC's snapshot copy and disk encoding handle);
* restore: the original restores the packed state and codecs into a fresh single-row cache (the batch
  meta_state has the single row's layout: write index, bits, seed, key bits, value bits); the batch
  cache is then re-initialised with its saved ``left_padding`` and takes over that state, with
  ``_idx`` = the restored write index and the saved ``offset``;
* reserve: the original runs on a view whose ``offset`` is ``_idx``; the grown state is taken over.

All three run once per prefix-cache store or restore, not per token.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _reproduce
from kvpatch.patches._numbers import difference, judge, worst
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="tq-prefix-snapshot",
    summary="BatchTurboQuantKVCache inherits the single-row prefix snapshot: slices with the offset array (ValueError)",
    distribution="mlx-vlm",
    affected=">=0.7.0,<=0.7.10",
    checked_through="0.7.10",
    reference="not reported upstream",
    catalogue="V31",
    expiry=Expiry(
        "retire when mlx-vlm's BatchTurboQuantKVCache snapshots, restores and reserves its packed prefix "
        "state itself (the reproduction then finds the bug absent)",
        review_by=_dt.date(2027, 3, 1),
    ),
)


@PATCH.replace("mlx_vlm.turboquant", "BatchTurboQuantKVCache.prefix_cache_snapshot")
def _build_snapshot(original: Any) -> Any:
    from types import SimpleNamespace

    def prefix_cache_snapshot(self: Any) -> Any:
        view = SimpleNamespace(
            meta_state=self.meta_state,
            keys=self.keys,
            values=self.values,
            offset=self._idx,
            key_codec=self.key_codec,
            value_codec=self.value_codec,
        )
        snapshot = original(view)
        snapshot["offset"] = self.offset
        snapshot["left_padding"] = self.left_padding
        return snapshot

    return prefix_cache_snapshot


@PATCH.replace("mlx_vlm.turboquant", "BatchTurboQuantKVCache.prefix_cache_restore")
def _build_restore(original: Any) -> Any:
    import mlx.core as mx
    from mlx_vlm.turboquant import TurboQuantKVCache

    def rows_of(state: Any) -> int:
        while isinstance(state, tuple):
            state = state[0]
        return 1 if state is None else state.shape[0]

    def prefix_cache_restore(self: Any, snapshot: Any) -> None:
        row = TurboQuantKVCache.__new__(TurboQuantKVCache)
        original(row, snapshot)  # packed state, codecs and meta_state, restored the single-row way
        left_padding = snapshot.get("left_padding")
        if left_padding is None:  # not written by the snapshot above: unpadded rows, all at the write index
            left_padding = mx.zeros((rows_of(row.keys),), dtype=mx.int32)
        offset = snapshot.get("offset")
        self.__init__(
            left_padding.tolist(), bits=row.bits, seed=row.seed, key_bits=row.key_bits, value_bits=row.value_bits
        )
        self.keys, self.values = row.keys, row.values
        self.key_codec, self.value_codec = row.key_codec, row.value_codec
        self._idx = row.offset
        self.offset = offset if offset is not None else self._idx - self.left_padding

    return prefix_cache_restore


@PATCH.replace("mlx_vlm.turboquant", "BatchTurboQuantKVCache.prefix_cache_reserve")
def _build_reserve(original: Any) -> Any:
    from types import SimpleNamespace

    def prefix_cache_reserve(self: Any, min_capacity_tokens: int) -> Any:
        view = SimpleNamespace(keys=self.keys, values=self.values, offset=self._idx, cache_step=self.cache_step)
        result = original(view, min_capacity_tokens)
        self.keys, self.values = view.keys, view.values
        return result

    return prefix_cache_reserve


@PATCH.reproduce
def reproduce() -> Finding:
    """Snapshot a left-padded batch TurboQuant cache, restore it into a fresh batch cache, reserve room
    and decode one more token in both: bookkeeping and attention output must match the original cache.
    Restore (from a single-row snapshot) and reserve (on a live cache) are also tried on their own."""
    import mlx.core as mx

    try:
        from mlx_vlm.turboquant import BatchTurboQuantKVCache, TurboQuantKVCache
    except ImportError as exc:
        return _reproduce.absent(exc, "this mlx-vlm has no BatchTurboQuantKVCache")
    if not hasattr(BatchTurboQuantKVCache, "prefix_cache_reserve"):
        return Finding(False, "this mlx-vlm has no packed prefix-cache contract on TurboQuant caches: nothing to fix")

    mx.random.seed(0)
    H, D, bits = 2, 32, 4
    prefill = [mx.random.normal((2, H, 6, D)) for _ in range(2)]
    step = [mx.random.normal((2, H, 1, D)) for _ in range(2)]
    q = mx.random.normal((2, H, 1, D))

    def decode(cache: Any) -> Any:
        k, v = cache.dequantize(*cache.update_and_fetch(*step))
        return _reproduce.left_padded_attention(q, k, v, cache.left_padding, D**-0.5)

    def batch() -> Any:
        cache = BatchTurboQuantKVCache([2, 0], bits=bits)
        cache.update_and_fetch(*prefill)
        return cache

    def fresh() -> Any:
        return BatchTurboQuantKVCache.__new__(BatchTurboQuantKVCache)  # how the APC restores a checkpoint

    problems, found = [], []
    cache = batch()
    try:
        restored = fresh()
        restored.prefix_cache_restore(cache.prefix_cache_snapshot())
        restored.prefix_cache_reserve(cache._idx + 8)
        got = (restored._idx, restored.offset.tolist(), restored.left_padding.tolist())
        want = (cache._idx, cache.offset.tolist(), cache.left_padding.tolist())
        if got != want:
            problems.append(f"round trip: restored (_idx, offset, left_padding) = {got}, original {want}")
        found.append(difference(decode(restored), decode(cache), where="round trip: the restored cache's next decode"))
    except (ValueError, TypeError) as exc:  # the bug's own errors: per-row arrays used as Python ints
        detail = symptom(exc, "Slice indices must be integers", "Only length-1 arrays", "left_padding")
        problems.append(f"snapshot/restore/reserve of a 2-row batch cache raises {type(exc).__name__}: {detail}")

    single = TurboQuantKVCache(bits=bits)
    single.update_and_fetch(prefill[0][:1], prefill[1][:1])
    try:
        fresh().prefix_cache_restore(single.prefix_cache_snapshot())
    except TypeError as exc:  # the bug's own error: the batch class rebuilt without its left_padding
        detail = symptom(exc, "left_padding")
        problems.append(f"prefix_cache_restore() on the batch class raises TypeError: {detail}")
    grown, plain = batch(), batch()
    try:
        grown.prefix_cache_reserve(grown._idx + 300)
        found.append(difference(decode(grown), decode(plain), where="the next decode after prefix_cache_reserve()"))
    except ValueError as exc:  # the bug's own error: the per-row offset used as a Python int
        detail = symptom(exc, "Only length-1 arrays", "Slice indices must be integers")
        problems.append(f"prefix_cache_reserve() on a 2-row batch cache raises ValueError: {detail}")
    return judge(
        worst(found),
        "the cache decodes differently from the original",
        "snapshot/restore/reserve round-trip a 2-row batch cache (the same next decode), also alone",
        problems=problems,
    )
