"""offset-detach (catalogue B1): BatchKVCache's per-row offset is a lazy graph that nothing evaluates.

Broken: in mlx-lm 0.28.0–0.32.2 ``mlx_lm.models.cache.BatchKVCache.update_and_fetch`` advances the
per-row ``offset`` array with ``offset + S`` on every call and never evaluates it. Layers whose graph
reads the offset (RoPE with ``offset=cache.offset``) evaluate it as a side effect; layers that never read
it (NoPE layers such as SmolLM3's every 4th layer, models that take positions from elsewhere) let the
chain grow by one Add and one Broadcast (5 edges of ``mx.export_to_dot``'s graph) per decoded token,
without bound. Measured here on 0.28.0, 0.30.7, 0.31.1 and 0.32.2: after 20 NoPE-style steps (outputs
evaluated every step) the offset's graph has 105 edges, after 200 steps 1005; over 20k steps the
process's peak RSS grew 30 MB more than with the fix (~150 MB per 100k steps) and the final evaluation
of the offset took 150 ms (0 with the fix). mlx-lm 0.27.1 has no BatchKVCache (out of range).

Upstream: not fixed (checked through 0.32.2). The twin in BatchRotatingKVCache was fixed by tying the
metadata into the cached keys with ``mx.depends`` (ml-explore/mlx-lm#960, 89c430a9, 0.31.1).
ml-explore/mlx-lm#1731 (closed unmerged) proposed the same guard for ``BatchKVCache.update_and_fetch`` (and
for ``ArraysCache.filter``/``extend``).

Fix: no code on the per-token path. ``update_and_fetch`` reads the class attribute ``step`` (256) only when
the keys buffer must grow, before it concatenates the old buffer with new zeros, and no other method of the class
reads it. From 0.28.1, where ``step`` is a class attribute, kvpatch serves it through a data descriptor
(``_lazy.growth_tie``): reading it in ``update_and_fetch`` on a cache whose keys are set makes those keys depend on
the current ``offset`` (``mx.depends``), once per growth, so the grown buffer (which every later step writes into
and the attention reads) evaluates the offset as it stood then. At most one buffer's worth of steps (256 ``+ 1``,
~1290 graph edges) is ever pending, whatever the number of steps; reading ``BatchKVCache.step`` on the class still
gives 256, an instance's own ``step`` is still honoured, and a read anywhere else (another thread polling the cache
included) changes nothing. ``mx.depends`` shares the keys' buffer (no extra memory), does no arithmetic, adds no
host synchronisation and leaves keys, values and offset bit-identical.

Why not a wrapper around ``update_and_fetch`` (tying every 10th call): measured on Python 3.12 (the H100
host's), any extra Python frame there costs ~2-7 us per call inside a model's forward pass (a bare
pass-through as much as the wrapper; on 3.11 nothing), ~1% of a small llama's decode speed. The wrapper remains
where there is no class attribute to serve: mlx-lm 0.28.0 sets ``self.step = 256`` in ``__init__``, and a vendored
copy of the class (``KVPATCH_VENDORED``) is patched through its ``update_and_fetch``. There, whenever the write
position (``_idx``) crosses a multiple of 10 (``_lazy.EVERY``), the incoming keys are tied to the current
``offset`` before the original writes them (<= 60 pending edges). mlx 0.29.0/0.29.1 (allowed by mlx-lm 0.28.x)
have no ``mx.depends``: there the keys are multiplied by an exact 1 derived from the offset (``x * 1.0`` is
bit-exact), decided once when the patch is built. ``update_and_fetch`` stays a target even where its builder
declines, so its source is still compared with the releases the fix was validated on (drift).
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _lazy
from kvpatch.patches._lazy import CHECKPOINTS, graph_edges
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="offset-detach",
    summary="BatchKVCache advances its per-row offset lazily and never evaluates it: unbounded graph on NoPE layers",
    distribution="mlx-lm",
    affected=">=0.28.0,<=0.32.2",
    checked_through="0.32.2",
    reference="ml-explore/mlx-lm#1731 (closed unmerged; twin fixed in BatchRotatingKVCache by ml-explore/mlx-lm#960)",
    catalogue="B1",
    hot_path=True,
    expiry=Expiry(
        "retire when mlx-lm's BatchKVCache evaluates or ties its offset (as #960 did for BatchRotatingKVCache)",
        review_by=_dt.date(2027, 3, 1),
    ),
)


@PATCH.replace("mlx_lm.models.cache", "BatchKVCache.step", optional=True)
def _step(original: Any) -> Any:
    """0.28.1+: the class attribute ``step``, served by the growth tie (0.28.0 has none: see the wrapper)."""
    return _lazy.serve_step(original)


@PATCH.replace("mlx_lm.models.cache", "BatchKVCache.update_and_fetch")
def _build(original: Any) -> Any:
    import mlx.core as mx
    import mlx_lm.models.cache as cache

    if _lazy.growth_tied(original, cache.BatchKVCache):
        return original  # upstream's class has a class attribute ``step``: the growth tie covers it

    tie = _lazy.tie(mx)
    every = _lazy.EVERY

    def update_and_fetch(self: Any, keys: Any, values: Any) -> Any:
        prev = self._idx
        if (prev + keys.shape[2]) // every != prev // every:  # the write crosses a multiple of EVERY
            keys = tie(keys, self.offset)
        return original(self, keys, values)

    return update_and_fetch


@PATCH.reproduce
def reproduce() -> Finding:
    """Decode steps on a NoPE-style layer: evaluate only keys/values, watch the offset's graph."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    mx.random.seed(0)
    B, H, D = 2, 2, 8
    first, last = CHECKPOINTS
    cache = BatchKVCache([2, 0])
    k, v = cache.update_and_fetch(mx.random.normal((B, H, 3, D)), mx.random.normal((B, H, 3, D)))
    mx.eval(k, v)
    steps = mx.random.normal((last, B, H, 1, D))
    mx.eval(steps)
    edges = {}
    for i in range(last):
        k, v = cache.update_and_fetch(steps[i], steps[i] + 1)
        mx.eval(k, v)  # what a NoPE layer's attention output evaluates
        if i + 1 in CHECKPOINTS:
            edges[i + 1] = graph_edges(cache.offset)
    offset = cache.offset.tolist()
    expected = [3 - 2 + last, 3 + last]
    detail = f"offset graph after {first} steps: {edges[first]} edges, after {last}: {edges[last]}; offset={offset}"
    if offset != expected:
        return Finding(True, f"{detail}, expected {expected}")
    if edges[last] > edges[first]:
        return Finding(True, f"{detail} (grows ~{(edges[last] - edges[first]) / (last - first):.1f} edges per step)")
    return Finding(False, f"{detail} (bounded)")
