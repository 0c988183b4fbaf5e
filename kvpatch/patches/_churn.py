"""Shared by churn-metadata-detach (mlx-lm) and churn-metadata-detach-vlm (mlx-vlm's own classes): the batch caches'
``extend`` / ``filter`` rebuild their per-row metadata lazily and nothing evaluates it.

* ``settle``: the builder of both units' ``extend`` / ``filter`` replacements (the original, then one evaluation of
  the small metadata arrays it left on the cache).
* ``churn_edges`` / ``churn_growth``: a server's batch under membership churn (a row joins, one decode step, the
  oldest row leaves), measured as the pending graph edges on the metadata; the reproduction of both units.
* ``vlm_own``: mlx-vlm's own class of a name, or None where ``mlx_vlm.models.cache`` re-exports mlx-lm's.

Not a patch unit (units live in the distribution folders). Imports mlx lazily.
"""

from __future__ import annotations

from typing import Any

from kvpatch.patches._lazy import graph_edges
from kvpatch.record import Finding, own_class

#: The per-row metadata ``extend`` / ``filter`` rebuild (absent names and non-arrays are skipped): ``offset`` and
#: ``left_padding`` of the batch KV caches, ``left_padding`` / ``lengths`` of ArraysCache (read through whatever
#: descriptor serves them, upstream's in mlx-vlm 0.6.16+ or arrays-advance-detach's), and the pending right-padding
#: arrays (``_right_padding``, ``_lengths``) where a filter lands between ``prepare`` and ``finalize``. ``_idx`` and
#: ``_offset`` are Python ints in every class these units patch: nothing to evaluate.
METADATA = ("offset", "left_padding", "lengths", "_right_padding", "_lengths")
#: Where the reproduction compares the metadata's graph: a fixed cache has none pending after any cycle.
CHECKPOINTS = (10, 200)
#: The rows of the batch that churns (one joins, one leaves, each cycle).
ROWS = 3


def vlm_own(name: str) -> Any:
    """``mlx_vlm.models.cache``'s class ``name`` where it is mlx-vlm's own (0.6.4+), else None (mlx-lm's class,
    re-exported: that one is churn-metadata-detach's)."""
    import mlx_vlm.models.cache as vlm_cache

    return own_class(vlm_cache, name)


def metadata(cache: Any) -> list[Any]:
    """The metadata arrays a cache holds now (a ``CacheList``'s children's, recursively)."""
    import mlx.core as mx

    children = getattr(cache, "caches", None)
    if children is not None:
        return [a for child in children for a in metadata(child)]
    return [a for a in (getattr(cache, name, None) for name in METADATA) if isinstance(a, mx.array)]


def settle(original: Any) -> Any:
    """``extend`` / ``filter`` that evaluates the per-row metadata the original left on the cache.

    The original builds ``offset`` / ``left_padding`` / ``lengths`` from the previous ones (a concatenation, an
    index, a shift) and nothing on the decode path evaluates them: ``BatchKVCache``'s mask reads the Python
    ``_idx``, and an ArraysCache's metadata is read only by the one layer a model builds its SSM mask from. A batch
    whose rows come and go keeps every such chain for its lifetime (18 graph edges per join-and-leave on
    ``BatchKVCache``, 13 on ArraysCache, without bound). Evaluating the metadata after each call cuts the chain: the
    arrays are a few integers per row and their graph holds only integer metadata (never keys, values or states),
    so the evaluation costs one small host synchronisation per call. ``extend`` and ``filter`` run when a request
    joins or leaves the batch, not per token, and upstream's ``BatchKVCache.filter`` already synchronises on
    ``left_padding`` (``tolist``/``item``) in the same call, so the per-token path is untouched and the
    per-request cost is of the kind the original already pays. Values are unchanged (evaluation only).
    """
    import mlx.core as mx

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        pending = metadata(self)
        if pending:
            mx.eval(*pending)  # looked up per call, as a server's own sweep does (its tests spy on mx.eval)
        return result

    return method


def pending_edges(cache: Any) -> int:
    """Pending graph edges on a cache's metadata (summed over its arrays; 0 once all are evaluated)."""
    return sum(graph_edges(a) for a in metadata(cache))


def _layers(module: Any, kind: str, rows: int) -> Any:
    """A fresh cache of ``kind`` for ``rows`` rows: ``BatchKVCache``, ``ArraysCache`` (left-padded, as mlx-lm's
    ``ArraysCache.merge`` and mlx-vlm's ``_make_cache`` leave it for decoding) or a ``CacheList`` of both."""
    if kind == "BatchKVCache":
        return module.BatchKVCache([0] * rows)
    if kind == "ArraysCache":
        return module.ArraysCache(2, left_padding=[0] * rows)
    return module.CacheList(_layers(module, "ArraysCache", rows), _layers(module, "BatchKVCache", rows))


def _run(cache: Any, rows: int, tokens: int, key: Any) -> list[Any]:
    """One forward pass over ``tokens`` tokens of every layer in ``cache``; returns what the layer's output reads
    (keys and values; a recurrent layer's states), which is all a server evaluates."""
    import mlx.core as mx

    out: list[Any] = []
    for layer in getattr(cache, "caches", None) or [cache]:
        if hasattr(layer, "update_and_fetch"):
            step = mx.random.normal((rows, 2, tokens, 8), key=key)
            out += list(layer.update_and_fetch(step, step + 1))
            continue
        if layer[0] is None:
            layer[0], layer[1] = mx.zeros((rows, 3, 4)), mx.zeros((rows, 4, 4))
        layer[0] = layer[0] * 0.5 + 1
        layer[1] = layer[1] * 0.5 + layer[0].sum(axis=1, keepdims=True)
        layer.advance(tokens)
        out += [layer[0], layer[1]]
    return out


def churn_edges(module: Any, kind: str, checkpoints: tuple[int, ...] = CHECKPOINTS) -> tuple[dict[int, int], Any]:
    """A batch of ``ROWS`` rows under membership churn, ``max(checkpoints)`` cycles of: a fresh one-row cache
    prefilled with 3 tokens joins (``extend``), one decode step (keys and values evaluated), the oldest row leaves
    (``filter``). Returns the metadata's pending edges after each checkpoint's cycle, and the cache."""
    import mlx.core as mx

    keys = mx.random.split(mx.random.key(0), 2)
    batch = _layers(module, kind, ROWS)
    mx.eval(_run(batch, ROWS, 3, keys[0]))
    edges = {}
    for cycle in range(1, max(checkpoints) + 1):
        row = _layers(module, kind, 1)
        mx.eval(_run(row, 1, 3, keys[0]))
        batch.extend(row)
        mx.eval(_run(batch, ROWS + 1, 1, keys[1]))
        batch.filter(mx.arange(1, ROWS + 1))
        if cycle in checkpoints:
            edges[cycle] = pending_edges(batch)
    return edges, batch


def churn_growth(module: Any, kinds: list[str]) -> Finding:
    """``churn_edges`` for each kind: present when the metadata's pending graph grows between the checkpoints."""
    first, last = CHECKPOINTS
    grows, notes = [], []
    for kind in kinds:
        edges, _ = churn_edges(module, kind)
        notes.append(f"{kind}: {edges[first]} -> {edges[last]}")
        if edges[last] > edges[first]:
            grows.append(kind)
    detail = f"metadata graph edges after {first} -> {last} join/decode/leave cycles: " + "; ".join(notes)
    if grows:
        return Finding(True, f"{detail} (unbounded: {', '.join(grows)})")
    return Finding(False, f"{detail} (bounded)")
