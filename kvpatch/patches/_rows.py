"""Shared by batch-quantized-extend (V02) and empty-tq-rows (V03): one bug in two batch caches.

When one side of ``extend`` has no keys yet, upstream keeps only the other side's packed rows while
``offset`` / ``left_padding`` count both. :func:`fill_missing_rows` adds the empty side's rows back (as
zeros, which its left padding masks). Not a patch unit (units live in the distribution folders).
"""

from __future__ import annotations

from typing import Any


def rows(state: Any) -> int | None:
    """Batch size of the first array in a (nested, NamedTuple) cache state."""
    if isinstance(state, tuple):
        for item in state:
            found = rows(item)
            if found is not None:
                return found
        return None
    shape = getattr(state, "shape", None)
    return shape[0] if shape else None


def pad_rows(state: Any, before: int, after: int) -> Any:
    """Insert zero rows along the batch axis of every array in a (nested, NamedTuple) state."""
    import mlx.core as mx

    if isinstance(state, mx.array):
        return mx.pad(state, [(before, after)] + [(0, 0)] * (state.ndim - 1))
    if isinstance(state, tuple):
        items = [pad_rows(item, before, after) for item in state]
        return type(state)(*items) if hasattr(state, "_fields") else tuple(items)
    return state


def fill_missing_rows(cache: Any, self_was_empty: bool, n_self: int, n_other: int) -> None:
    """After ``cache.extend(other)`` with exactly one side empty: give the empty side its rows back.

    Does nothing when the packed state already has a row per batch entry (upstream already fixed).
    """
    missing = n_self if self_was_empty else n_other
    if rows(cache.keys) == n_self + n_other - missing:
        before, after = (missing, 0) if self_was_empty else (0, missing)
        cache.keys = pad_rows(cache.keys, before, after)
        cache.values = pad_rows(cache.values, before, after)


def zero_length_like(cache: Any, like: Any) -> None:
    """Give an empty batch cache zero-length keys/values in ``like``'s dtype, heads and head dims.

    Shared by batch-extend-empty (mlx-lm, D2+F1) and vlm-batch-extend-dtype (mlx-vlm's copy): upstream's
    ``extend`` pads the empty side from float32 placeholders, so a bf16 batch came back float32.
    """
    import mlx.core as mx

    rows = cache.offset.shape[0]
    heads, k_dim = like.keys.shape[1], like.keys.shape[3]
    cache.keys = mx.zeros((rows, heads, 0, k_dim), dtype=like.keys.dtype)
    cache.values = mx.zeros((rows, heads, 0, like.values.shape[3]), dtype=like.values.dtype)
