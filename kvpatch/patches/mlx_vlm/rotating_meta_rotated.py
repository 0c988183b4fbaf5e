"""vlm-rotating-meta-rotated: mlx-vlm's own BatchRotatingKVCache copy restores as rotated.

Broken: mlx-vlm carries its own ``BatchRotatingKVCache`` from 0.6.4, copied with mlx-lm's ``meta_state``
setter (``self.rotated = bool(v[3])``, true for ``"False"``; mlx-lm's twin is ``rotating-meta-rotated``).
mlx-vlm's prefix cache restores caches exactly this way (``apc_adapters.CheckpointAdapter.restore`` and
``_BaseCache.prefix_cache_restore`` set ``state`` then ``meta_state`` on a fresh cache; ``from_state``
likewise). Measured (2 rows, left padding [2, 0], 6 prompt tokens, window 16, restored into a fresh cache,
one decode step): ``left_padding`` [1, -1] instead of [2, 0], attention output off by 0.918, on 0.6.4,
0.6.13, 0.6.14, 0.6.16, 0.7.0, 0.7.6, 0.7.8 and 0.7.10. Before 0.6.4 ``mlx_vlm.models.cache.BatchRotatingKVCache``
is mlx-lm's class (fixed by ``rotating-meta-rotated`` there), and this patch leaves it alone.

Upstream: not reported to mlx-vlm; not fixed as of 0.7.10 (mlx-lm's report: ml-explore/mlx-lm#1250).

Fix: the same delta as mlx-lm's: the original setter runs, then ``rotated`` is read back from the string
``meta_state`` wrote. Once per restore, never per token.
"""

from __future__ import annotations

import datetime as _dt

from kvpatch.patches import _meta_rotated
from kvpatch.record import Expiry, Finding, Patch, own_class

PATCH = Patch(
    id="vlm-rotating-meta-rotated",
    summary="mlx-vlm's BatchRotatingKVCache.meta_state setter reads rotated with bool('False'): restores look wrapped",
    distribution="mlx-vlm",
    affected=">=0.6.4,<=0.7.10",
    checked_through="0.7.10",
    catalogue="N7 (mlx-vlm's copy)",
    own_classes_only=True,
    reference="not reported to mlx-vlm (mlx-lm twin: ml-explore/mlx-lm#1250)",
    expiry=Expiry(
        "retire when mlx-vlm's BatchRotatingKVCache reads rotated back as a bool",
        review_by=_dt.date(2027, 3, 1),
    ),
)


PATCH.replace("mlx_vlm.models.cache", "BatchRotatingKVCache.meta_state")(_meta_rotated.build_setter)


@PATCH.reproduce
def reproduce() -> Finding:
    """Restore a non-rotated mlx-vlm batch rotating cache via state + meta_state; one decode step must match."""
    from mlx_vlm.models import cache

    if own_class(cache, "BatchRotatingKVCache") is None:
        return Finding(False, skipped="mlx_vlm.models.cache.BatchRotatingKVCache is mlx-lm's class here")
    return _meta_rotated.reproduce(cache)
