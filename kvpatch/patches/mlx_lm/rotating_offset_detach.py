"""rotating-offset-detach (catalogue B2): BatchRotatingKVCache's offset and left_padding grow lazy graphs.

Broken: in mlx-lm 0.28.1–0.31.0 ``mlx_lm.models.cache.BatchRotatingKVCache`` advances its per-row
``offset`` (``+ S``) on every update and, once the window has rotated, its ``left_padding`` (``- S``),
in ``_update_in_place`` and ``_update_concat``, and never evaluates either. Only the cache the model
builds its mask from reads ``left_padding``, and NoPE layers never read ``offset``, so on every other
layer the chains grow by a few graph nodes per decoded token without bound. Measured on 0.28.1 and
0.30.7 (window 8, outputs evaluated every step): after 200 decode steps the offset's graph has 1005
edges and left_padding's 975 (after 20 steps 105 and 75); with this patch both stay at 5, on 0.31.1
(upstream's fix) at 0. 0.31.0 (PyPI) still has it, so the range runs to the fixing release (the catalogue
says 0.30.7). 0.28.0 has no BatchRotatingKVCache (out of range).

Upstream: ml-explore/mlx-lm#960 (89c430a9), released in 0.31.1: both update paths tie ``offset`` and
``left_padding`` into the cached keys with ``mx.depends``.

Fix: a delta in front of the original ``update_and_fetch`` (the one entry point to both update paths):
the incoming keys are made to depend on the current ``offset`` and ``left_padding`` before the original
writes them into the window, so evaluating the step's attention output evaluates both as they stood
before the step. At most one step's ``+ S`` / ``- S`` is ever pending. ``mx.depends`` shares the keys'
buffer (no copy, no arithmetic, no host synchronisation): keys, values, offset and left_padding stay
bit-identical. On mlx without ``mx.depends`` (0.29.0/0.29.1) the keys are multiplied by an exact 1
derived from both arrays instead, decided once when the patch is built.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _lazy
from kvpatch.patches._lazy import graph_edges
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="rotating-offset-detach",
    summary="BatchRotatingKVCache advances offset/left_padding lazily and never evaluates them: unbounded graphs",
    distribution="mlx-lm",
    affected=">=0.28.1,<0.31.1",
    fixed_in="0.31.1",
    fixed_commit="89c430a9",
    reference="ml-explore/mlx-lm#960",
    catalogue="B2",
    hot_path=True,
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-lm < 0.31.1",
        review_by=_dt.date(2027, 6, 1),
    ),
)


@PATCH.replace("mlx_lm.models.cache", "BatchRotatingKVCache.update_and_fetch")
def _build(original: Any) -> Any:
    import mlx.core as mx

    tie = _lazy.tie(mx)

    def update_and_fetch(self: Any, keys: Any, values: Any) -> Any:
        return original(self, tie(keys, [self.offset, self.left_padding]), values)

    return update_and_fetch


@PATCH.reproduce
def reproduce() -> Finding:
    """Decode past the window on a layer that reads neither offset nor left_padding; watch both graphs."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchRotatingKVCache

    mx.random.seed(0)
    B, H, D = 2, 2, 8
    cache = BatchRotatingKVCache(8, [2, 0])
    k, v = cache.update_and_fetch(mx.random.normal((B, H, 3, D)), mx.random.normal((B, H, 3, D)))
    mx.eval(k, v)
    steps = mx.random.normal((200, B, H, 1, D))
    mx.eval(steps)
    edges = {}
    for i in range(200):
        k, v = cache.update_and_fetch(steps[i], steps[i] + 1)
        mx.eval(k, v)  # what the attention output of such a layer evaluates
        if i + 1 in (20, 200):
            edges[i + 1] = (graph_edges(cache.offset), graph_edges(cache.left_padding))
    offset = cache.offset.tolist()
    expected = [3 - 2 + 200, 3 + 200]
    detail = f"offset/left_padding graph edges after 20 steps: {edges[20]}, after 200: {edges[200]}; offset={offset}"
    if offset != expected:
        return Finding(True, f"{detail}, expected {expected}")
    return _lazy.growth_finding(detail, edges)
