"""offset-rebind-vlm: mlx-vlm's batch caches move ``offset`` in place (the twin of mlx-lm's offset-rebind).

Broken: ``update_and_fetch`` of ``mlx_vlm.models.cache.BatchQuantizedKVCache`` and
``mlx_vlm.turboquant.BatchTurboQuantKVCache`` (0.5.0–0.7.10), and of mlx-vlm's own copies of
``BatchKVCache`` / ``BatchRotatingKVCache`` (0.6.4–0.7.10), advance ``offset`` with ``self.offset += S``, which
updates the ``mx.array`` object in place: a model that binds ``cache.offset`` before the update and reads it
after gets the post-update value. mlx-lm fixed its classes in 0.32.0 (ml-explore/mlx-lm#1848); mlx-vlm
0.7.10's copies still do it. Measured (kept handle before an update, read after): moves in every class
on 0.5.0 (quantized, TurboQuant), 0.6.4, 0.6.16, 0.7.0 and 0.7.10 (all four). mlx-vlm's own ``gemma3n`` copies
the offset first (since b0275383) and is fine; the model files of 0.7.10 that keep an offset across
an update are listed in the test module. Before 0.6.4 ``BatchKVCache`` / ``BatchRotatingKVCache`` in
``mlx_vlm.models.cache`` are mlx-lm's classes, fixed by ``offset-rebind`` there and left alone here.

Upstream: not reported to mlx-vlm; not fixed as of 0.7.10.

Fix: the same delta as mlx-lm's: a second handle on the same array (``mx.array(offset)``: no data copy, no
graph node, no evaluation) becomes the cache's offset before the original runs; the handle a model kept
keeps its value. Composes with offset-detach-vlm on the same methods (either order).
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _offset_rebind
from kvpatch.record import Expiry, Finding, Patch, own_class

PATCH = Patch(
    id="offset-rebind-vlm",
    summary="mlx-vlm batch caches advance offset in place: a model's kept offset handle moves with the cache",
    distribution="mlx-vlm",
    affected=">=0.5.0,<=0.7.10",
    checked_through="0.7.10",
    catalogue="N6 (mlx-vlm's copies)",
    reference="not reported to mlx-vlm (mlx-lm twin: ml-explore/mlx-lm#1806, fixed by #1848)",
    hot_path=True,
    order=90,
    own_classes_only=True,
    expiry=Expiry(
        "retire when mlx-vlm's batch caches rebind offset instead of += (as mlx-lm 0.32.0 does)",
        review_by=_dt.date(2027, 3, 1),
    ),
)


def _own(name: str) -> Any:
    """mlx-vlm's own class ``name`` in mlx_vlm.models.cache (0.6.4+), or None where it is mlx-lm's."""
    import mlx_vlm.models.cache as vlm_cache

    return own_class(vlm_cache, name)


PATCH.replace("mlx_vlm.turboquant", "BatchTurboQuantKVCache.update_and_fetch")(_offset_rebind.build)
PATCH.replace("mlx_vlm.models.cache", "BatchQuantizedKVCache.update_and_fetch")(_offset_rebind.build)
PATCH.replace("mlx_vlm.models.cache", "BatchKVCache.update_and_fetch", optional=True)(_offset_rebind.build)
PATCH.replace("mlx_vlm.models.cache", "BatchRotatingKVCache.update_and_fetch", optional=True)(_offset_rebind.build)


@PATCH.reproduce
def reproduce() -> Finding:
    """Keep ``cache.offset``, update the cache, check the kept handle, for every class mlx-vlm owns here."""
    from mlx_vlm.models.cache import BatchQuantizedKVCache
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    found = {
        "BatchQuantizedKVCache": BatchQuantizedKVCache([2, 0], group_size=64, bits=8),
        "BatchTurboQuantKVCache": BatchTurboQuantKVCache([2, 0], bits=3),
    }
    kv, rotating = _own("BatchKVCache"), _own("BatchRotatingKVCache")
    if kv is not None:
        found["BatchKVCache"] = kv([2, 0])
    if rotating is not None:
        found["BatchRotatingKVCache"] = rotating(16, [2, 0])
    present, detail = _offset_rebind.check(found)
    return Finding(present, detail)
