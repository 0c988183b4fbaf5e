"""vlm-batch-trim-capped (catalogue C4, mlx-vlm's copy): mlx-vlm's BatchKVCache.trim(n) trims rows shorter than n
past their start (negative offset, hidden token).

Broken: from 0.6.4 mlx-vlm has its own ``BatchKVCache`` (``mlx_vlm.models.cache``; before, it re-exported mlx-lm's,
which ``batch-trim-capped`` patches) with mlx-lm's ``trim``: ``n`` capped by the shared write index ``_idx`` and
subtracted from every row, so a left-padded row holding fewer than ``n`` tokens is trimmed past its own start. With
``left_padding=[4, 0]`` after 5 tokens, ``trim(2)`` leaves ``offset=[-1, 3]``: that row's next token is hidden by its
own mask and gets RoPE position -1. Found by kvpatch's bug hunt (``offsets-agree`` after ``trim`` on vlm-0.6.4, with
kvpatch on: no patch covered mlx-vlm's copy) and measured with this unit's reproduction (batch-trim-capped's, on
mlx-vlm's class) on 0.6.4 and 0.7.10: offset [-1, 3] without the patch, the never-appended cache's offsets and
attention with it.

Upstream: ml-explore/mlx-lm#873 (closed unmerged) describes the shared-``_idx`` limitation of the class mlx-vlm
copies; not fixed in mlx-vlm as of 0.7.10.

Fix: batch-trim-capped's delta (``kvpatch/patches/_trim.py``), after the original: once ``n > 0`` positions are
trimmed, a row that lost all of its tokens becomes an empty row (``offset`` clamped to 0, ``left_padding`` to
``_idx``); rows that held at least ``n`` tokens are unchanged. Two lazy array ops, no host synchronisation; trim may
run every step (speculative decoding), so it is treated as a hot path.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _trim
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    # every field: CONTRIBUTING.md, "The record"
    id="vlm-batch-trim-capped",
    summary="mlx-vlm's BatchKVCache.trim(n) trims rows shorter than n past their start (negative offset, hidden token)",
    distribution="mlx-vlm",
    affected=">=0.6.4,<=0.7.10",
    checked_through="0.7.10",
    reference="ml-explore/mlx-lm#873 (closed unmerged; mlx-lm's class, which mlx-vlm copies)",
    catalogue="C4 (mlx-vlm's copy; found by the bug hunt)",
    hot_path=True,
    expiry=Expiry(
        "retire when an mlx-vlm release fixes it (`python -m kvpatch upstream-check` measures the newest)",
        review_by=_dt.date(2027, 5, 30),
    ),
)


@PATCH.replace("mlx_vlm.models.cache", "BatchKVCache.trim")
def _build(original: Any) -> Any:
    return _trim.capped(original)


@PATCH.reproduce
def reproduce() -> Finding:
    """Trim 2 from rows of mlx-vlm's BatchKVCache holding 1 and 5 tokens; the next step must match a cache that never
    had them."""
    from mlx_vlm.models.cache import BatchKVCache

    return _trim.reproduce(BatchKVCache)
