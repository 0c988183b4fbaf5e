"""Shared by the mlx-vlm model patches whose layers derive mRoPE positions from a cache offset (glm4v-batch-positions,
qwen35-batch-positions): the per-row positions of a batch cache.

Not a patch unit (the registry skips modules whose name starts with ``_``). Imports mlx lazily.
"""

from __future__ import annotations

from typing import Any


def row_positions(mx: Any) -> Any:
    """``positions(offset, length)``: for a per-row ``offset`` array of a batch cache, the ``(3, B, length)``
    mRoPE position ids ``offset[:, None] + arange(length)`` (each row's own positions: a left-padded row's pad
    slots get negative ones, which its mask hides); None for anything else (an int offset: the model's own code)."""
    array, arange, broadcast_to = mx.array, mx.arange, mx.broadcast_to

    def positions(offset: Any, length: int) -> Any:
        if not isinstance(offset, array) or offset.ndim != 1:
            return None
        rows = offset[:, None] + arange(length)
        return broadcast_to(rows[None], (3, *rows.shape))

    return positions
