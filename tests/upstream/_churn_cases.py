"""Checks shared by the tests of churn-metadata-detach (mlx-lm's batch caches) and churn-metadata-detach-vlm
(mlx-vlm's own copies): a batch under membership churn keeps no pending metadata graph, with values unchanged."""

from __future__ import annotations

from typing import Any

from kvpatch.patches import _churn
from kvpatch.testing import without

#: Where the edge count is compared: the reproduction's checkpoints and one more, further on.
CHECKPOINTS = (*_churn.CHECKPOINTS, 500)


#: A read of metadata with decrements pending (arrays-advance-detach, where upstream's filter leaves ``lengths``
#: alone: mlx-lm 0.30.4-0.31.1) computes ``base - total`` afresh: that subtraction's few edges, never a chain.
READ_EDGES = 8


def bounded(module: Any, kind: str) -> None:
    """Pending edges on the metadata stay flat however many rows came and went (18 more per cycle unpatched):
    none, or the few of one fresh read."""
    edges, _ = _churn.churn_edges(module, kind, CHECKPOINTS)
    assert len(set(edges.values())) == 1 and max(edges.values()) <= READ_EDGES, (kind, edges)


def values(cache: Any) -> list[Any]:
    """Everything the churn leaves that a later step reads: metadata, keys/values, states (a CacheList's children's)."""
    out: list[Any] = []
    for layer in getattr(cache, "caches", None) or [cache]:
        out += [None if a is None else a.tolist() for a in (getattr(layer, n, None) for n in _churn.METADATA)]
        out += [getattr(layer, "_idx", None)]
        arrays = getattr(layer, "cache", None) or [getattr(layer, "keys", None), getattr(layer, "values", None)]
        out += [None if a is None else a.tolist() for a in arrays]
    return out


def same_values(module: Any, kind: str, patch_id: str) -> None:
    """The churned batch holds exactly what it holds with the patch taken out."""
    _, patched = _churn.churn_edges(module, kind, (30,))
    with without(patch_id):
        _, unpatched = _churn.churn_edges(module, kind, (30,))
        expected = values(unpatched)
    assert values(patched) == expected, kind
