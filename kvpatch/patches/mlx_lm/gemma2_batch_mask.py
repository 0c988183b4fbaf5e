"""gemma2-batch-mask (catalogue issue 36 (found by the bug hunt)): gemma2's attention crashes on a batch's per-row
mask (batched generation of several prompts raises broadcast_shapes).

Broken: ``mlx_lm.models.gemma2.Attention.__call__`` computes grouped-query attention itself, in five dimensions
(queries reshaped to ``(B, kv_heads, repeats, L, head_dim)``), and adds or applies the mask it is given as it comes.
A single prompt's mask (``(L, S)`` or ``(1, 1, L, S)``) broadcasts against those scores; a batch's per-row mask,
``(B, 1, L, S)`` as ``BatchKVCache`` makes it for left-padded rows, does not (B lines up with ``kv_heads``), so
every forward pass of two or more prompts raises ``ValueError: [broadcast_shapes] Shapes (B,1,L,S) and
(B,kv_heads,repeats,L,S) cannot be broadcast``. ``BatchGenerator`` (and ``mlx_lm.server``, which runs on it) cannot
generate for a gemma2 model with more than one request at a time. Every model with ``num_attention_heads >
num_key_value_heads`` (all released gemma2 checkpoints). The code is the same in 0.28.0 (the first release with
batch caches) through 0.32.2; found by kvpatch's bug hunt (``logits-agree``/``model-runs`` at the model level) and
measured with this unit's reproduction: the ValueError on 0.32.2 without the patch; with it, each row's logits equal
the row alone, prefill and decode.

Upstream: not reported upstream (found by kvpatch's bug hunt); not fixed as of 0.32.2.

Fix: a delta in front of the original: a four-dimensional mask array, when the layer groups its queries
(``repeats > 1``), gets a unit axis for the repeats (``(B, 1, 1, L, S)``), which broadcasts against the five-dimensional
scores row by row; the original then runs unchanged. A single prompt's mask gives the same scores either way (a unit
axis is only a broadcast), a string or absent mask and a layer without grouping pass as they are. Hot path (per layer
per step): a plain function, one shape test on the mask and an ``expand_dims`` view, no host synchronisation. The
delta and the reproduction are ``kvpatch/patches/_grouped_mask.py``'s, shared with mlx-vlm's copy of gemma2
(``vlm-gemma2-batch-mask``).
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _grouped_mask, _reproduce
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    # every field: CONTRIBUTING.md, "The record"
    id="gemma2-batch-mask",
    summary=(
        "gemma2's attention crashes on a batch's per-row mask (batched generation of several prompts raises "
        "broadcast_shapes)"
    ),
    distribution="mlx-lm",
    affected=">=0.28.0,<=0.32.2",
    checked_through="0.32.2",
    reference="not reported upstream (found by kvpatch's bug hunt)",
    catalogue="issue 36 (found by the bug hunt)",
    hot_path=True,
    expiry=Expiry(
        "retire when an mlx-lm release fixes it (`python -m kvpatch upstream-check` measures the newest)",
        review_by=_dt.date(2027, 5, 30),
    ),
)


@PATCH.replace("mlx_lm.models.gemma2", "Attention.__call__")
def _build(original: Any) -> Any:
    return _grouped_mask.build(original)


def tiny_model() -> Any:
    """A tiny random gemma2 (hidden 64, 2 layers, 4 query heads over 2 KV heads of 16, vocabulary 64)."""
    from mlx_lm.models.gemma2 import Model, ModelArgs

    return _reproduce.seeded(Model, ModelArgs(**_grouped_mask.TINY_GEMMA2))


@PATCH.reproduce
def reproduce() -> Finding:
    """A tiny gemma2 over a left-padded batch of two prompts, against each prompt alone."""
    return _grouped_mask.reproduce(tiny_model, "mlx_lm.models.cache", "gemma2")
