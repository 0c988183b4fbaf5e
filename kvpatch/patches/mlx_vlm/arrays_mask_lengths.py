"""vlm-arrays-mask-lengths: mlx-vlm's own ArraysCache.make_mask drops the lengths mask when left padding is set.

Broken: the twin of ``arrays-mask-lengths`` in mlx-vlm's own ``mlx_vlm.models.cache.ArraysCache``
(0.6.4+, from git a492e47d / #1494; before, mlx-vlm used mlx-lm's class): ``make_mask(N)`` returns
``arange(N) >= left_padding`` whenever ``left_padding`` is set and applies ``lengths`` (set by
``prepare(lengths=...)`` for a right-padded prefill) only when it is not. mlx-vlm's own batch prefill
sets both (0.7.10, ``generate/ar.py``): ``_make_cache`` gives every ArraysCache ``left_padding`` (zeros
when the batch is right-padded), then the automatic-prefix-cache mixed prefill calls
``prepare(right_padding=..., lengths=...)`` on every cache. Pad tokens then update the recurrent state
of the shorter rows in every model that builds its SSM mask with ``create_ssm_mask`` (LFM2, Qwen3-Next,
Mamba-2, Nemotron-H, Jamba, Kimi-Linear, GraniteMoeHybrid, ...).

Measured (Linux, mlx[cpu]): ``make_mask(5)`` with ``left_padding=[1, 0]``, ``lengths=[5, 3]`` leaves
row 1's pads valid on every release with the class: 0.6.4, 0.6.5, 0.6.13, 0.6.15, 0.6.16, 0.7.0, 0.7.6,
0.7.8 and 0.7.10. A tiny random mlx-vlm Qwen3.5 (1 GDN + 1 attention layer), rows ``[1..8]`` and
``[pad, 10, 11, pad x5]`` (``left_padding=[0, 1]``, ``lengths=[8, 3]``): row 1's recurrent state differs
from ``[10, 11]`` prefilled alone by 0.019 (0.6.4, 0.6.15) and 0.339 (0.7.10); 0.0 with the patch.
(Qwen3.5's own ``_create_qwen3_5_ssm_mask`` returns no mask at all when every row's left padding is 0,
also with ``lengths`` set: a separate model-level bug, not this one.) mlx-lm fixed its copy in 0.32.0;
mlx-vlm's is unchanged as of 0.7.10.

Upstream: not reported for mlx-vlm's copy (the mlx-lm twin: ml-explore/mlx-lm#1736).

Fix: the same delta as ``arrays-mask-lengths`` (shared in ``_arrays``): with both set, the original's
mask is ANDed with ``arange(N) < lengths``; otherwise the original's result is returned unchanged. Lazy,
no host synchronisation. Before 0.6.4 ``mlx_vlm.models.cache.ArraysCache`` is mlx-lm's class and this
patch leaves it alone (``own_classes_only``).
"""

from __future__ import annotations

import datetime as _dt

from kvpatch.patches import _arrays
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="vlm-arrays-mask-lengths",
    summary="mlx-vlm's own ArraysCache.make_mask ignores lengths (right padding) when left_padding is set",
    distribution="mlx-vlm",
    affected=">=0.6.4,<=0.7.10",
    introduced_commit="a492e47d",
    checked_through="0.7.10",
    catalogue="N5 (mlx-vlm's copy)",
    reference="not reported upstream for mlx-vlm's copy (mlx-lm twin: ml-explore/mlx-lm#1736, fixed in 0.32.0)",
    hot_path=True,
    own_classes_only=True,
    expiry=Expiry(
        "retire when mlx-vlm's ArraysCache.make_mask combines the left-padding and lengths masks",
        review_by=_dt.date(2027, 3, 1),
    ),
)


PATCH.replace("mlx_vlm.models.cache", "ArraysCache.make_mask")(_arrays.combined_make_mask)


@PATCH.reproduce
def reproduce() -> Finding:
    """A left- and right-padded prefill chunk's mask on mlx-vlm's own class (see ``_arrays``)."""
    return _arrays.on_vlm_own_class(_arrays.mask_drops_lengths, "arrays-mask-lengths")
