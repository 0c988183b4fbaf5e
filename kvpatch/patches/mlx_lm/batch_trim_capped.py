"""batch-trim-capped (catalogue C4): BatchKVCache.trim(n) over-trims rows shorter than n.

Broken: ``mlx_lm.models.cache.BatchKVCache.trim(n)`` caps ``n`` by the shared write index ``_idx`` (the
longest row plus its padding) and subtracts it from every row. A left-padded row holding fewer than ``n``
tokens is trimmed past its own start: with ``left_padding=[4, 0]`` after 5 tokens, ``trim(2)`` leaves
``_idx=3``, ``left_padding=[4, 0]``, ``offset=[-1, 3]``. That row's next token is written at index 3,
which its own mask (``left_padding <= index``) hides, and it gets RoPE position -1: its next logits are
wrong (max diff 1.22 in the catalogue; 3.69 measured with the tests' tiny llama, seed 0). Measured on
every release with the class, 0.28.0–0.32.2 (0.24.0 has no BatchKVCache).

Upstream: not fixed as of 0.32.2. ml-explore/mlx-lm#873 (per-sequence ``BatchKVCache`` trim for batched
speculative decoding, closed unmerged) describes the shared-``_idx`` limitation behind it.

Fix: a delta after the original. Once the original has trimmed ``n > 0`` positions, a row whose
``left_padding`` now exceeds ``_idx`` has lost all of its tokens: it becomes an empty row, i.e. its
``left_padding`` is clamped to ``_idx`` and its ``offset`` to 0, exactly the state of a row that never
appended those tokens. BatchKVCache keeps ``offset == _idx - left_padding`` per row (construction,
update, prepare/finalize, filter, extend, merge and trim all preserve it), so "left_padding > _idx" is
"offset < 0" and the two clamps (``mx.maximum(offset, 0)``, ``mx.minimum(left_padding, _idx)``) touch
exactly those rows; rows that held at least ``n`` tokens are unchanged. Two lazy array ops, no host
synchronisation; ``n`` is the Python int the original returns, and nothing changes when it is 0 (a
fresh cache's negative offsets are pending left padding, not over-trimming). Trim may run every step
(speculative decoding), so it is treated as a hot path.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches._numbers import difference, judge, worst
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="batch-trim-capped",
    summary="BatchKVCache.trim(n) trims rows shorter than n past their start (negative offset, hidden token)",
    distribution="mlx-lm",
    affected=">=0.28.0,<=0.32.2",
    checked_through="0.32.2",
    reference="ml-explore/mlx-lm#873 (closed unmerged)",
    catalogue="C4",
    hot_path=True,
    expiry=Expiry(
        "retire when an mlx-lm release trims each BatchKVCache row by at most its own length",
        review_by=_dt.date(2027, 3, 1),
    ),
)


@PATCH.replace("mlx_lm.models.cache", "BatchKVCache.trim")
def _build(original: Any) -> Any:
    import mlx.core as mx

    def trim(self: Any, n: int) -> int:
        n = original(self, n)
        if n > 0:
            self.offset = mx.maximum(self.offset, 0)
            self.left_padding = mx.minimum(self.left_padding, self._idx)
        return n

    return trim


@PATCH.reproduce
def reproduce() -> Finding:
    """Trim 2 from rows holding 1 and 5 tokens; the next step must match a cache that never had them."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    mx.random.seed(0)
    H, D = 2, 8
    k = mx.random.normal((2, H, 5, D))
    v = mx.random.normal((2, H, 5, D))
    q1, k1, v1 = (mx.random.normal((2, H, 1, D)) for _ in range(3))

    cache = BatchKVCache([4, 0])  # row 0 holds 1 token, row 1 holds 5
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
