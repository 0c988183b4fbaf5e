"""offset-detach-vlm (catalogue V32): mlx-vlm's batch caches advance their offset lazily, never evaluated.

Broken: in mlx-vlm 0.5.0–0.7.10 ``mlx_vlm.models.cache.BatchQuantizedKVCache.update_and_fetch`` and
``mlx_vlm.turboquant.BatchTurboQuantKVCache.update_and_fetch`` (and, from 0.6.4, mlx-vlm's own copy of
``BatchKVCache``) advance the per-row ``offset`` with ``offset + S`` on every call and never evaluate it.
On a layer that does not read the offset (NoPE layers, positions taken from elsewhere) the chain grows
by 5 graph edges per decoded token without bound. TurboQuant's own ``mx.eval(self.keys, self.values)``
every 50 steps does not reach the offset. Measured here on 0.5.0, 0.6.3, 0.6.4 and 0.7.10 (outputs
evaluated every step): each cache's offset graph has 55 edges after 10 steps, 305 after 60. mlx-vlm's
generators evaluate cache state every 50 steps, which bounds it there; custom decode loops (servers
driving the model directly) are unbounded. Before 0.6.4 ``mlx_vlm.models.cache.BatchKVCache`` IS
mlx-lm's class: that one is fixed by ``offset-detach`` and this patch leaves it alone (``own_classes_only``).

Upstream: not fixed (checked through 0.7.10). mlx-lm fixed the twin in BatchRotatingKVCache with
``mx.depends`` (ml-explore/mlx-lm#960); mlx-vlm's BatchRotatingKVCache copy (0.6.4+) carries that fix.

Fix: a delta in front of each original of the quantized and TurboQuant classes. The incoming keys are made to
depend on the current ``offset`` (``mx.depends``) before the original quantizes and stores them, so evaluating
anything that reads this step's keys also evaluates the offset as it stood before the step: at most one ``+ S``
stays pending. mlx-vlm's own BatchKVCache (0.6.4+) has offset-detach's layout (a class attribute ``step`` read
only when the keys buffer grows): there, as in offset-detach, ``step`` is served by ``_lazy.growth_tie``, which
ties the offset into the keys once per growth (every 256 tokens) and runs no code per token; its
``update_and_fetch`` stays a target (drift is watched there), declined for upstream's class and wrapped as above
in a vendored copy. ``mx.depends`` shares the keys' buffer (no copy, no arithmetic, no host synchronisation);
stored keys, values and offsets are bit-identical. mlx releases without ``mx.depends`` (< 0.29.2) predate every
mlx-vlm release this patches; the fallback (an exact ``* 1`` derived from the offset) is kept anyway.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _lazy
from kvpatch.patches._lazy import CHECKPOINTS, graph_edges
from kvpatch.record import Expiry, Finding, Patch, own_class

PATCH = Patch(
    id="offset-detach-vlm",
    summary="mlx-vlm batch (quantized, TurboQuant, own BatchKVCache) caches never evaluate their lazy offset",
    distribution="mlx-vlm",
    affected=">=0.5.0,<=0.7.10",
    checked_through="0.7.10",
    reference="not reported upstream (mlx-lm twin fixed by ml-explore/mlx-lm#960)",
    catalogue="V32",
    hot_path=True,
    own_classes_only=True,
    expiry=Expiry(
        "retire when mlx-vlm's batch caches evaluate or tie their offset",
        review_by=_dt.date(2027, 3, 1),
    ),
)


def _tie_offset(original: Any) -> Any:
    import mlx.core as mx

    tie = _lazy.tie(mx)

    def update_and_fetch(self: Any, keys: Any, values: Any) -> Any:
        return original(self, tie(keys, self.offset), values)

    return update_and_fetch


@PATCH.replace("mlx_vlm.models.cache", "BatchQuantizedKVCache.update_and_fetch")
@PATCH.replace("mlx_vlm.turboquant", "BatchTurboQuantKVCache.update_and_fetch")
def _build(original: Any) -> Any:
    return _tie_offset(original)


def own_batch_kv_cache() -> Any:
    """mlx-vlm's own BatchKVCache class (0.6.4+), or None where it re-exports mlx-lm's."""
    import mlx_vlm.models.cache as vlm_cache

    return own_class(vlm_cache, "BatchKVCache")


# mlx-vlm's own BatchKVCache (0.6.4+): its class attribute ``step``, served by the growth tie
PATCH.replace("mlx_vlm.models.cache", "BatchKVCache.step", optional=True)(_lazy.serve_step)


@PATCH.replace("mlx_vlm.models.cache", "BatchKVCache.update_and_fetch", optional=True)
def _build_own_batch_kv(original: Any) -> Any:
    import mlx_vlm.models.cache as vlm_cache

    if _lazy.growth_tied(original, vlm_cache.BatchKVCache):
        return original  # upstream's own class: the growth tie on ``step`` covers it (a vendored copy is wrapped)
    return _tie_offset(original)


def caches() -> dict[str, Any]:
    """Fresh left-padded ([2, 0]) instances of every class this patch covers in the running mlx-vlm."""
    from mlx_vlm.models.cache import BatchQuantizedKVCache
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    found = {
        "BatchQuantizedKVCache": BatchQuantizedKVCache([2, 0], group_size=64, bits=8),
        "BatchTurboQuantKVCache": BatchTurboQuantKVCache([2, 0], bits=3),
    }
    own = own_batch_kv_cache()
    if own is not None:
        found["BatchKVCache"] = own([2, 0])
    return found


def arrays(tree: Any) -> list[Any]:
    """The arrays inside an ``update_and_fetch`` result (tuples, TurboQuant state proxies, ...)."""
    import mlx.core as mx

    if tree is None:
        return []
    if isinstance(tree, mx.array):
        return [tree]
    return [a for item in tree for a in arrays(item)]


def checkpoints(name: str) -> tuple[int, int]:
    """Where the reproduction compares a class's offset graph: BatchKVCache is tied when its buffer grows (every
    256 tokens), so past the first growth and 1280 steps later (offset-detach's); the others every step."""
    return CHECKPOINTS if name == "BatchKVCache" else (10, 60)


@PATCH.reproduce
def reproduce() -> Finding:
    """Decode steps on a NoPE-style layer for each cache class: evaluate only the outputs, watch the offset."""
    import mlx.core as mx

    mx.random.seed(0)
    B, H, D = 2, 2, 64
    prompt = mx.random.normal((B, H, 3, D))
    steps = mx.random.normal((CHECKPOINTS[1], B, H, 1, D))
    mx.eval(prompt, steps)
    grows, notes = [], []
    for name, cache in caches().items():
        first, last = checkpoints(name)
        mx.eval(arrays(cache.update_and_fetch(prompt, prompt + 1)))
        edges = {}
        for i in range(last):
            mx.eval(arrays(cache.update_and_fetch(steps[i], steps[i] + 1)))  # what attention reads
            if i + 1 in (first, last):
                edges[i + 1] = graph_edges(cache.offset)
        offset = cache.offset.tolist()
        notes.append(f"{name}: {edges[first]} -> {edges[last]} edges after {first} -> {last} steps, offset={offset}")
        if offset != [3 - 2 + last, 3 + last] or edges[last] > edges[first]:
            grows.append(name)
    detail = "offset graph " + "; ".join(notes)
    if grows:
        return Finding(True, f"{detail} (unbounded: {', '.join(grows)})")
    return Finding(False, f"{detail} (bounded)")
