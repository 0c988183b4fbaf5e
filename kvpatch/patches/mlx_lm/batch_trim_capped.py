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
(speculative decoding), so it is treated as a hot path. The delta and the reproduction are
``kvpatch/patches/_trim.py``'s, shared with mlx-vlm's copy of the class (``vlm-batch-trim-capped``).
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _trim
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
    return _trim.capped(original)


@PATCH.reproduce
def reproduce() -> Finding:
    """Trim 2 from rows holding 1 and 5 tokens; the next step must match a cache that never had them."""
    from mlx_lm.models.cache import BatchKVCache

    return _trim.reproduce(BatchKVCache)
