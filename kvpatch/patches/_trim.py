"""The delta and reproduction of batch-trim-capped and its mlx-vlm twin: ``BatchKVCache.trim(n)`` caps ``n`` by the
shared write index and subtracts it from every row, so a left-padded row holding fewer than ``n`` tokens is trimmed
past its own start (negative offset, its next token hidden by its own mask)."""

from __future__ import annotations

from typing import Any

from kvpatch.patches._numbers import difference, judge, worst
from kvpatch.record import Finding


def capped(original: Any) -> Any:
    """``trim(self, n)`` after ``original``: once ``n > 0`` positions are trimmed, a row whose ``left_padding`` now
    exceeds ``_idx`` (``offset < 0``: it lost all of its tokens) becomes an empty row (``offset`` clamped to 0,
    ``left_padding`` to ``_idx``); rows that held at least ``n`` tokens are unchanged. Two lazy array ops."""
    import mlx.core as mx

    def trim(self: Any, n: int) -> int:
        n = original(self, n)
        if n > 0:
            self.offset = mx.maximum(self.offset, 0)
            self.left_padding = mx.minimum(self.left_padding, self._idx)
        return n

    return trim


def reproduce(batch_cache: Any) -> Finding:
    """Trim 2 from rows holding 1 and 5 tokens of ``batch_cache`` (a ``BatchKVCache`` class); the next step must
    match a cache that never had them."""
    import mlx.core as mx

    mx.random.seed(0)
    H, D = 2, 8
    k = mx.random.normal((2, H, 5, D))
    v = mx.random.normal((2, H, 5, D))
    q1, k1, v1 = (mx.random.normal((2, H, 1, D)) for _ in range(3))

    cache = batch_cache([4, 0])  # row 0 holds 1 token, row 1 holds 5
    cache.update_and_fetch(k, v)
    cache.trim(2)
    offset = cache.offset.tolist()
    mask = cache.make_mask(1)
    keys, values = cache.update_and_fetch(k1, v1)
    out = mx.fast.scaled_dot_product_attention(q1, keys, values, scale=D**-0.5, mask=mask)

    # Never appended: row 0 is empty (only the new token), row 1 holds its first 3 tokens.
    want0 = v1[0]  # one key: attention returns its value
    kk = mx.concatenate([k[1:, :, :3], k1[1:]], axis=2)
    vv = mx.concatenate([v[1:, :, :3], v1[1:]], axis=2)
    want1 = mx.fast.scaled_dot_product_attention(q1[1:], kk, vv, scale=D**-0.5)[0]
    found = [difference(out[0], want0, where="row 0"), difference(out[1], want1, where="row 1")]
    problems = [] if offset == [0, 3] else [f"after trim(2) offset={offset} (never-appended: [0, 3])"]
    return judge(
        worst(found),
        "the next step's attention differs from the never-appended cache",
        "trim(2) empties the 1-token row (offset [0, 3]); next step matches the never-appended cache",
        problems=problems,
    )
