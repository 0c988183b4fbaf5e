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

Fix: a delta in front of the original. Whenever the write position (``_idx``, a Python int) crosses a
multiple of 10 (``_lazy.EVERY``: every 10th decode step, and every prefill chunk of 10 or more tokens), the
incoming keys are made to depend on the current ``offset`` (``mx.depends``) before the original writes them
into the cache, so evaluating anything that reads this step's keys (the attention output) also evaluates the
offset as it stood before the step. At most 10 ``+ S`` are ever pending (<= 60 graph edges), whatever the
number of steps; the tie's node is built once per 10 calls (the other calls add one integer comparison).
``mx.depends`` shares the keys' buffer (measured: no extra memory), does no arithmetic, adds no host
synchronisation and leaves keys, values and offset bit-identical; the cost is one extra graph node per layer
every 10th step (about 3 us of CPU time here; tying every step cost BatchKVCache.update_and_fetch alone ~10%).
mlx 0.29.0/0.29.1 (allowed by mlx-lm 0.28.x) have no ``mx.depends``:
there the keys are multiplied by an exact 1 derived from the offset (``x * 1.0`` is bit-exact), decided
once when the patch is built.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _lazy
from kvpatch.patches._lazy import graph_edges

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


@PATCH.replace("mlx_lm.models.cache", "BatchKVCache.update_and_fetch")
def _build(original: Any) -> Any:
    import mlx.core as mx

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
    cache = BatchKVCache([2, 0])
    k, v = cache.update_and_fetch(mx.random.normal((B, H, 3, D)), mx.random.normal((B, H, 3, D)))
    mx.eval(k, v)
    steps = mx.random.normal((200, B, H, 1, D))
    mx.eval(steps)
    edges = {}
    for i in range(200):
        k, v = cache.update_and_fetch(steps[i], steps[i] + 1)
        mx.eval(k, v)  # what a NoPE layer's attention output evaluates
        if i + 1 in (20, 200):
            edges[i + 1] = graph_edges(cache.offset)
    offset = cache.offset.tolist()
    expected = [3 - 2 + 200, 3 + 200]
    detail = f"offset graph after 20 steps: {edges[20]} edges, after 200: {edges[200]}; offset={offset}"
    if offset != expected:
        return Finding(True, f"{detail}, expected {expected}")
    if edges[200] > edges[20]:
        return Finding(True, f"{detail} (grows ~{(edges[200] - edges[20]) / 180:.1f} edges per step)")
    return Finding(False, f"{detail} (bounded)")
