"""Shared by batch-extract-right-padding (mlx-lm) and batch-extract-right-padding-vlm (mlx-vlm's own copies): one
bug in both origins of the batch caches. Not a patch unit (units live in the distribution folders).

A right-padded prefill declares its padding with ``prepare(right_padding=..., lengths=...)``; the model then
writes each short row's real tokens followed by its pad tokens, and ``finalize()`` rolls the written pads to
the front as left padding. Until then the pads sit at the tail of the row's written region, and upstream
``extract(idx)`` copies them out as if they were tokens. What is pending, per row:

* ``BatchRotatingKVCache`` keeps ``_lengths = lengths + offset`` (offset at ``prepare``): the pads written
  so far are ``max(0, offset - _lengths)``, the amount its own ``finalize`` rolls.
* ``BatchKVCache`` / ``BatchQuantizedKVCache`` keep only ``_right_padding`` (``finalize`` assumes every
  declared pad has been written) and drop ``lengths``. Between chunks of a chunked prefill a row may hold
  none or some of its pads (mlx-vlm's APC checkpoints extract a row exactly at its last real token, before
  any pad: upstream is right there and must stay so), so :func:`record_ends` keeps what ``prepare`` was told,
  ``offset + lengths`` as the rotating class does, under :data:`ENDS`, and :func:`dense_pending` counts
  ``clip(offset - ends, 0, right_padding)``. Without ``lengths`` (``prepare(right_padding=...)`` alone, used
  by mlx-vlm's speculative rollback right before ``finalize``) it falls back to ``finalize``'s own
  assumption: all declared pads are written.

The extract delta runs the original and cuts the row's written pads from the tail of the single-row cache it
returns (keys, values, ``offset``; ``_idx`` for a rotating cache). The live batch cache is not touched.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvpatch.patches._numbers import Difference, difference, exact, judge, worst
from kvpatch.record import Finding

#: Instance attribute holding ``offset + lengths`` from the last patched ``prepare`` (None: not known).
ENDS = "_kvpatch_right_padding_ends"


def record_ends(original: Any) -> Any:
    """A builder for ``prepare``: also remember where each row's real tokens end (``offset + lengths``)."""
    import mlx.core as mx

    def prepare(self: Any, *, left_padding: Any = None, lengths: Any = None, right_padding: Any = None) -> Any:
        result = original(self, left_padding=left_padding, lengths=lengths, right_padding=right_padding)
        ends = None
        if lengths is not None and getattr(self, "_right_padding", None) is not None:
            ends = self.offset + mx.array(lengths)  # lazy, like the rotating class's own _lengths
        setattr(self, ENDS, ends)
        return result

    return prepare


def dense_pending(cache: Any) -> Any:
    """Per row, the declared right padding already written at the tail (``BatchKVCache``-like caches), or None."""
    import mlx.core as mx

    padding = getattr(cache, "_right_padding", None)
    if padding is None or padding.shape != cache.offset.shape:
        return None  # nothing pending, or pending state of another batch (unfiltered): left to upstream
    ends = getattr(cache, ENDS, None)
    if ends is None or ends.shape != cache.offset.shape:
        return padding
    return mx.minimum(mx.maximum(cache.offset - ends, 0), padding)


def rotating_pending(cache: Any) -> Any:
    """Per row, the right padding written and not yet rolled (``BatchRotatingKVCache``), or None."""
    import mlx.core as mx

    lengths = getattr(cache, "_lengths", None)
    if lengths is None or lengths.shape != cache.offset.shape:
        return None
    return mx.maximum(cache.offset - lengths, 0)


def drop_tail(cache: Any, n: int) -> None:
    """Remove the last ``n`` stored positions of a single-row cache ``extract`` returned (not rotated): keys and
    values (dense, or quantized tuples), ``offset``, and ``_idx`` where the class has one (RotatingKVCache)."""
    import mlx.core as mx

    if cache.keys is None:
        return
    quantized = isinstance(cache.keys, tuple)
    length = (cache.keys[0] if quantized else cache.keys).shape[2]
    keep = max(length - n, 0)

    def cut(stored: Any) -> Any:
        if isinstance(stored, tuple):
            return tuple(mx.contiguous(part[..., :keep, :]) for part in stored)
        return mx.contiguous(stored[..., :keep, :])

    cache.keys, cache.values = cut(cache.keys), cut(cache.values)
    cache.offset = cache.offset - (length - keep)
    if hasattr(cache, "_idx"):
        cache._idx = keep


def extract_without_pending(pending: Any) -> Any:
    """A builder for ``extract``: the original, then the row's written pads cut from the tail of what it returned.

    Whatever the release's ``extract`` slices (from the row's left padding to the write index; 0.28.4-0.30.x's
    rotating class keeps the whole buffer when the row has no left padding), the pads written so far are the
    last positions it returns, in temporal order: a cache with right padding pending is never rotated (updates
    then go through the concatenating path, which puts it in temporal order first). ``extract`` runs per
    finished or saved row, not per token; like the original (which reads the row's padding with ``.item()`` /
    ``.tolist()``) it reads the row's pending count on the host.
    """

    def build(original: Any) -> Any:
        def extract(self: Any, idx: int) -> Any:
            tail = pending(self)
            if tail is None or getattr(self, "rotated", False):
                return original(self, idx)
            n = tail.tolist()[idx]
            cache = original(self, idx)
            if n > 0:
                drop_tail(cache, n)
            return cache

        return extract

    return build


# -- for reproductions and tests ---------------------------------------------------------------------------------


def _floats(cache: Any, stored: Any) -> Any:
    """Dense keys/values as floats (a uniform quantized cache stores (packed, scales, biases) tuples)."""
    import mlx.core as mx

    if isinstance(stored, tuple):
        return mx.dequantize(*stored, group_size=cache.group_size, bits=cache.bits)
    return stored


def _valid_keys(cache: Any) -> Any:
    """The first ``offset`` stored keys of a single-row cache (not rotated), as floats."""
    keys = cache.keys
    if isinstance(keys, tuple):
        keys = tuple(part[..., : cache.offset, :] for part in keys)
    else:
        keys = keys[..., : cache.offset, :]
    return _floats(cache, keys)


def extract_compared(
    make_batch: Any, make_alone: Any, chunks: tuple[int, ...], lengths: tuple[int, ...] = (3, 5)
) -> tuple[list[str], list[Difference]]:
    """What differs between rows extracted during a right-padded prefill and the rows prefilled alone.

    ``make_batch(rows)`` builds an empty batch cache, ``make_alone()`` the single-row cache ``extract`` returns.
    The rows (``lengths`` real tokens, right-padded to the longest) are written in ``chunks`` before each row is
    extracted (no ``finalize``); a row is compared with its first ``min(length, written)`` tokens prefilled
    alone: ``offset`` and the stored keys (moved data: exact; the structural problems), then one decode step on
    both (attention output of the step's keys: the differences)."""
    import mlx.core as mx

    width = max(lengths)
    rows = len(lengths)
    split = mx.random.split(mx.random.key(0), 2)
    k1, k2 = split[0], split[1]
    keys = mx.random.normal((rows, 2, width, 64), key=k1)
    step = mx.random.normal((1, 2, 1, 64), key=k2)
    batch = make_batch(rows)
    batch.prepare(right_padding=[width - n for n in lengths], lengths=list(lengths))
    written = 0
    for n in chunks:
        part = keys[:, :, written : written + n]
        batch.update_and_fetch(part, -part)
        written += n
    problems, found = [], []
    for row, length in enumerate(lengths):
        real = min(length, written)
        got = batch.extract(row)
        alone = make_alone()
        alone.update_and_fetch(keys[row : row + 1, :, :real], -keys[row : row + 1, :, :real])
        if got.offset != alone.offset:
            problems.append(f"row {row} ({real} real tokens) extracted with offset={got.offset}, alone {alone.offset}")
            continue
        stored, expected = _valid_keys(got), _valid_keys(alone)
        if not exact(stored, expected):
            problems.append(f"row {row}: stored keys {stored.shape} differ from the row alone {expected.shape}")
            continue
        outs = []
        for cache in (got, alone):
            k, v = cache.update_and_fetch(step, -step)
            k, v = _floats(cache, k), _floats(cache, v)
            outs.append(mx.fast.scaled_dot_product_attention(step, k, v, scale=64**-0.5))
        found.append(difference(outs[0], outs[1], where=f"row {row}: the next decode step"))
    return problems, found


def extract_finding(
    classes: dict[str, tuple[Any, Any]],
    chunkings: tuple[tuple[int, ...], ...] = ((5,), (3, 2)),
    lengths: tuple[int, ...] = (3, 5),
) -> Finding:
    """:func:`extract_compared` of each ``name: (make_batch, make_alone)``, prefilled in each of ``chunkings`` (by
    default in one chunk and in two), judged (:func:`~kvpatch.patches._numbers.judge`)."""
    problems, found = [], []
    for name, (make_batch, make_alone) in classes.items():
        for chunks in chunkings:
            wrong, measured = extract_compared(make_batch, make_alone, chunks, lengths)
            problems += [f"{name}, chunks {chunks}: {p}" for p in wrong]
            found += [replace(d, where=f"{name}, chunks {chunks}, {d.where}") for d in measured]
    return judge(
        worst(found),
        "an extracted row decodes differently from the row alone",
        f"{', '.join(classes)}: a row extracted before finalize() equals the row prefilled alone",
        problems=problems,
    )
