"""vlm-gemma2-batch-mask (catalogue issue 36 (found by the bug hunt; mlx-vlm's copy of gemma2-batch-mask)): mlx-
vlm's gemma2 attention crashes on a batch's per-row mask (batched generation of several prompts raises
broadcast_shapes).

Broken: mlx-vlm's own copy of gemma2 (``mlx_vlm.models.gemma2.language``, from 0.6.6) has mlx-lm's attention:
grouped-query scores in five dimensions (``(B, kv_heads, repeats, L, S)``) and the mask applied as it comes, so a
batch's per-row ``(B, 1, L, S)`` mask (mlx-vlm's ``BatchKVCache`` for left-padded rows) does not broadcast and
every forward pass of two or more prompts of different lengths raises ``ValueError: [broadcast_shapes]``. Found by
kvpatch's bug hunt (``model-runs`` on vlm-0.7.10, through the batch caches mlx-vlm's generator builds) and measured
with this unit's reproduction on 0.7.10: the ValueError without the patch; with it, each row's logits equal the row
alone, prefill and decode. The attention is the same in 0.6.6–0.7.10 (0.7.0 adds a dequantization of a quantized
cache's state before the scores, which the fix does not touch).

Upstream: not reported upstream (found by kvpatch's bug hunt); not fixed as of 0.7.10.

Fix: ``gemma2-batch-mask``'s delta (``kvpatch/patches/_grouped_mask.py``): in front of the original, a
four-dimensional mask array of a layer that groups its queries gets a unit axis for the repeats and broadcasts row
by row; a single prompt's mask gives the same scores (a unit axis is only a broadcast), anything else passes as it
is. Hot path: a plain function, one shape test and an ``expand_dims`` view.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _grouped_mask, _reproduce
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    # every field: CONTRIBUTING.md, "The record"
    id="vlm-gemma2-batch-mask",
    summary=(
        "mlx-vlm's gemma2 attention crashes on a batch's per-row mask (batched generation of several prompts raises "
        "broadcast_shapes)"
    ),
    distribution="mlx-vlm",
    affected=">=0.6.6,<=0.7.10",
    checked_through="0.7.10",
    reference="not reported upstream (found by kvpatch's bug hunt)",
    catalogue="issue 36 (found by the bug hunt; mlx-vlm's copy of gemma2-batch-mask)",
    hot_path=True,
    expiry=Expiry(
        "retire when an mlx-vlm release fixes it (`python -m kvpatch upstream-check` measures the newest)",
        review_by=_dt.date(2027, 5, 30),
    ),
)


@PATCH.replace("mlx_vlm.models.gemma2.language", "Attention.__call__")
def _build(original: Any) -> Any:
    return _grouped_mask.build(original)


def tiny_model() -> Any:
    """A tiny random mlx-vlm gemma2 ``LanguageModel`` (hidden 64, 2 layers, 4 query heads over 2 KV heads of 16,
    vocabulary 64)."""
    from mlx_vlm.models.gemma2.config import ModelConfig
    from mlx_vlm.models.gemma2.language import LanguageModel

    return _reproduce.seeded(LanguageModel, ModelConfig(**_grouped_mask.TINY_GEMMA2))


@PATCH.reproduce
def reproduce() -> Finding:
    """A tiny mlx-vlm gemma2 over a left-padded batch of two prompts, against each prompt alone."""
    return _grouped_mask.reproduce(tiny_model, "mlx_vlm.models.cache", "mlx-vlm's gemma2")
