"""Checks shared by the tests of arrays-advance-detach (mlx-lm's ArraysCache) and vlm-arrays-advance-detach
(mlx-vlm's own, 0.6.4-0.6.15): both install ``_arrays``' deferred metadata on their class. Each takes the
class and the patch id and runs only where that patch is installed."""

from __future__ import annotations

import copy
import warnings
from typing import Any

from kvpatch.patches import _arrays
from kvpatch.patches._lazy import MAX_EDGES, graph_edges

import kvpatch
from kvpatch.testing import without


def advance(cache: Any, steps: int, n: int = 1) -> None:
    """``steps`` decode steps of a recurrent layer: read the state, store a new one, advance, evaluate the state."""
    import mlx.core as mx

    for _ in range(steps):
        cache[0] = cache[0] * 0.5 + 1
        cache.advance(n)
        mx.eval(cache[0])


def new_cache(cls: type, padding: list[int], lengths: list[int]) -> Any:
    import mlx.core as mx

    cache = cls(1, left_padding=padding)
    cache.prepare(lengths=lengths)
    cache[0] = mx.zeros((len(padding), 3))
    mx.eval(cache[0])
    return cache


def metadata(cache: Any) -> tuple[list[int], list[int]]:
    return cache.left_padding.tolist(), cache.lengths.tolist()


def exact_when_taken_out_and_back(cls: type, patch_id: str) -> None:
    """Decrements deferred before the patch goes out reach the attribute; those made while it is out (upstream's
    own ``-=``) and after it is back add up; a writer's new array starts afresh."""
    import mlx.core as mx

    cache = new_cache(cls, [7, 3], [9, 12])
    advance(cache, 23)
    with without(patch_id):
        assert type(vars(cls).get("left_padding")) is not property  # upstream's plain attribute again
        assert vars(cache)["left_padding"].tolist() == [7 - 23, 3 - 23]  # flushed into the attribute itself
        assert not [key for key in vars(cache) if key.startswith("_kvpatch")]
        advance(cache, 13)
    advance(cache, 17, n=2)
    assert metadata(cache) == ([7 - 70, 3 - 70], [9 - 70, 12 - 70])
    cache.left_padding = mx.array([5, 6])  # as prepare/filter/extend/merge do: a new array
    advance(cache, 14)
    assert metadata(cache) == ([5 - 14, 6 - 14], [9 - 84, 12 - 84])
    advance(cache, 40)
    assert max(graph_edges(cache.left_padding), graph_edges(cache.lengths)) <= MAX_EDGES


def nothing_joins_the_graph(cls: type) -> None:
    """No step of a decode carries a node kvpatch added; the metadata read after 60 steps is one subtraction."""
    tied, left_padding, lengths = _arrays.decode_ties(cls, 60)
    assert tied == [], tied
    assert left_padding.tolist() == [4 - 60, 1 - 60] and lengths.tolist() == [6 - 60, 9 - 60]
    assert graph_edges(left_padding) == graph_edges(lengths) <= 5


def reads_do_not_stack(cls: type) -> None:
    """A read never builds on an earlier read's node: reading every step without evaluating keeps the graph at one
    subtraction over the stored array (upstream's chain, read or not, grows by one subtraction per step)."""
    cache = new_cache(cls, [2, 0], [4, 6])
    edges = []
    for _ in range(40):
        advance(cache, 1)
        edges.append((graph_edges(cache.left_padding), graph_edges(cache.lengths), getattr(cache, "batch_size", 2)))
    assert set(edges) == {edges[0]} and edges[0][0] <= 5, edges
    assert metadata(cache) == ([2 - 40, 0 - 40], [4 - 40, 6 - 40])
    assert cache.left_padding is cache.left_padding  # the same array until the next advance, as upstream's


def copies_stay_exact(cls: type, patch_id: str) -> None:
    """Copies (``copy.copy``, ``copy.deepcopy``: a server's prompt cache) carry the deferred totals with the stored
    array; taking the patch out flushes every one, advanced since or not."""
    cache = new_cache(cls, [5, 2], [8, 9])
    advance(cache, 11)
    shallow, deep, idle = copy.copy(cache), copy.deepcopy(cache), copy.deepcopy(cache)
    advance(cache, 3)
    advance(shallow, 5)
    advance(deep, 7, n=2)
    assert metadata(cache) == ([5 - 14, 2 - 14], [8 - 14, 9 - 14])
    assert metadata(shallow) == ([5 - 16, 2 - 16], [8 - 16, 9 - 16])
    with without(patch_id):
        for each, steps in ((cache, 14), (shallow, 16), (deep, 25), (idle, 11)):
            assert vars(each)["left_padding"].tolist() == [5 - steps, 2 - steps], (each, steps)
            assert vars(each)["lengths"].tolist() == [8 - steps, 9 - steps], (each, steps)
    assert metadata(deep) == ([5 - 25, 2 - 25], [8 - 25, 9 - 25])


def behaves_as_an_attribute(cls: type) -> None:
    """Where upstream's instance attribute would be missing, deleted or set, the descriptor does the same."""
    import mlx.core as mx

    bare = object.__new__(cls)
    vars(bare).pop("left_padding", None)
    assert not hasattr(bare, "left_padding")
    cache = new_cache(cls, [3, 1], [4, 4])
    advance(cache, 2)
    cache.lengths = None  # finalize()
    advance(cache, 3)
    assert cache.lengths is None and cache.left_padding.tolist() == [3 - 5, 1 - 5]
    del cache.left_padding
    assert not hasattr(cache, "left_padding")
    cache.left_padding = mx.array([9, 9])
    assert cache.left_padding.tolist() == [9, 9]


def restore_hook_errors_are_noted(patch: Any) -> None:
    """A restore hook that raises is noted on the status and never raised: taking the patch out still works."""

    def broken() -> None:
        raise RuntimeError("broken on purpose")

    engine = kvpatch.get_engine()
    patch.restore_hooks.append(broken)
    try:
        with warnings.catch_warnings(record=True) as caught, without(patch.id):
            pass
    finally:
        patch.restore_hooks.remove(broken)
    assert len(caught) <= 1, [str(w.message) for w in caught]  # once per process (none if warned before)
    notes = engine.status[patch.id].notes
    assert any("broken on purpose" in note for note in notes), notes
    notes[:] = [note for note in notes if "broken on purpose" not in note]
    assert engine.status[patch.id].installed
