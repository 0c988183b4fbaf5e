"""arrays-mask-lengths: ArraysCache.make_mask drops the lengths (right padding) mask when left padding is set.

Broken: in mlx-lm 0.30.4–0.31.3 ``mlx_lm.models.cache.ArraysCache.make_mask(N)`` returns
``arange(N) >= left_padding`` whenever ``left_padding`` is set, and the ``lengths`` mask installed by
``prepare(lengths=...)`` (right-padded prefill) only when it is not. With both set, a shorter row's
right-pad positions count as valid: recurrent layers that gate their state update with this mask
(Gated DeltaNet in Qwen3-Next / Qwen3.5, Mamba-2, ...) fold the pad tokens into the row's state.
mlx-lm 0.31.3's BatchGenerator hits it on every mixed-length batch: ``ArraysCache.merge`` of fresh
caches sets ``left_padding = zeros(B)`` and the prompt step then right-pads with ``prepare(lengths=...)``.

Measured (Linux, mlx[cpu]): ``make_mask(5)`` with ``left_padding=[1, 0]``, ``lengths=[5, 3]`` leaves
row 1's pads valid on 0.30.4, 0.30.7, 0.31.1, 0.31.2 and 0.31.3; 0.32.0 and 0.32.2 mask both. A tiny
random Qwen3-Next (1 linear + 1 attention layer) in mlx-lm 0.31.3's BatchGenerator, prompts of 9, 3 and
5 tokens: the shorter rows' log-probabilities differ from the same prompts run alone by up to 0.024
(0.0 with the patch). 0.30.4–0.31.2's BatchGenerator never sets both (their batches match either way),
but the cache method is wrong there too, for servers that drive it. Before 0.30.4 ArraysCache has no
``lengths`` (out of range).

Upstream: ml-explore/mlx-lm#1736 (closed; first part); mlx-lm 0.32.0 combines the two masks (no public
commit: 0.32.x is not in the public history).

Fix: a delta after the original. When both ``left_padding`` and ``lengths`` are set, the original's
left-padding mask is ANDed with ``arange(N) < lengths``, which is what 0.32.0 returns; in every other
case the original's result is returned unchanged. Lazy, no host synchronisation (``make_mask`` runs once
per forward pass, per SSM-mask layer).
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _arrays
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="arrays-mask-lengths",
    summary="ArraysCache.make_mask ignores lengths (right padding) when left_padding is set",
    distribution="mlx-lm",
    affected=">=0.30.4,<0.32.0",
    fixed_in="0.32.0",
    catalogue="N5 (issue 12 item 5)",
    reference="ml-explore/mlx-lm#1736",
    hot_path=True,
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-lm < 0.32.0",
        review_by=_dt.date(2027, 6, 1),
    ),
)


@PATCH.replace("mlx_lm.models.cache", "ArraysCache.make_mask")
def _build(original: Any) -> Any:
    return _arrays.combined_make_mask(original)


@PATCH.reproduce
def reproduce() -> Finding:
    """A left- and right-padded prefill chunk's mask (see ``_arrays.mask_drops_lengths``)."""
    from mlx_lm.models.cache import ArraysCache

    return _arrays.mask_drops_lengths(ArraysCache)
