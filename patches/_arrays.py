"""Shared by the ArraysCache patches of mlx-lm and mlx-vlm's own copy (mlx-vlm 0.6.4+): one bug, two classes.

* ``rebase_advance`` (arrays-advance-detach, vlm-arrays-advance-detach): ``advance`` decrements
  ``left_padding`` / ``lengths`` lazily and nothing evaluates them; ``advance_growth`` measures it, and
  ``anchored_ties`` which steps of a decode the fix adds a node to.
* ``combined_make_mask``: ``make_mask`` returns only the left-padding mask when both ``left_padding`` and
  ``lengths`` are set (arrays-mask-lengths, vlm-arrays-mask-lengths); ``mask_drops_lengths`` measures it.

Not a patch unit (the registry skips modules whose name starts with ``_``). Imports mlx lazily.
"""

from __future__ import annotations

from typing import Any

from kvpatch.patches import _lazy
from kvpatch.patches._lazy import graph_edges

from kvpatch.record import Finding

#: ``rebase_advance``'s per-instance book (an attribute only kvpatch uses): [the replacement that wrote it, calls
#: and steps advanced since the last rebase, {attribute name: (the array on the cache, kvpatch's anchor, the
#: steps advanced from the anchor to the last rebase)}].
BOOK = "_kvpatch_rebase"
_METADATA = ("left_padding", "lengths")


def vlm_own_arrays_cache() -> Any:
    """mlx-vlm's own ArraysCache class (0.6.4+), or None where ``mlx_vlm.models.cache`` has mlx-lm's."""
    import mlx_vlm.models.cache as vlm_cache

    cls = getattr(vlm_cache, "ArraysCache", None)
    if cls is None or not cls.__module__.startswith("mlx_vlm."):
        return None
    return cls


def rebase_advance(original: Any) -> Any:
    """``ArraysCache.advance`` whose metadata never holds more than ``_lazy.EVERY`` pending decrements, and
    whose steady state evaluates nothing.

    The original decrements ``left_padding`` and ``lengths`` in place (``-= N``: the Python object on the cache
    stays the same, its graph grows by one subtraction). kvpatch keeps, per attribute, an anchor (its own
    handle on the value at some point, evaluated since) and the Python sum of the ``N`` seen after it. Every
    ``EVERY``-th call of a cache, each of the two that is set is rebased: its pending chain is dropped
    unevaluated and replaced with ``anchor - total``, one lazy subtraction that nothing evaluates unless the
    model reads the attribute (as upstream's chain would be). No node joins the model's graph: the kernels
    a decode step runs are the ones it runs unpatched.

    Rebasing is exact only when every decrement since the anchor went through this replacement, so it is done
    only when the attribute still holds the array kvpatch put there (every other writer of these attributes
    in mlx-lm 0.30.4-0.32.2 assigns a new array: ``prepare``, ``filter``, ``extend``, ``merge``, ``state``),
    the book was written by this very replacement (a patch taken out and put back gets a new one: decrements
    made while it was out are not lost) and every ``N`` was a Python int. Otherwise kvpatch re-anchors: the
    current chain becomes the anchor and is tied into the first stored state entry with ``mx.depends`` (the
    layer's next step reads that entry, so it evaluates the anchor once). Re-anchoring happens when a cache
    is new or another method replaced its metadata, not periodically. No host synchronisation.
    """
    import mlx.core as mx

    tie = _lazy.tie(mx)
    every = _lazy.EVERY
    handle = mx.array

    def advance(self: Any, N: Any) -> Any:
        result = original(self, N)
        state = self.__dict__
        book = state.get(BOOK)
        if book is None or book[0] is not advance:
            book = state[BOOK] = [advance, 0, 0, {}]
        book[1] += 1
        book[2] += N
        if book[1] < every:
            return result
        steps, book[1], book[2] = book[2], 0, 0
        entries = self.cache
        first = next((i for i, entry in enumerate(entries) if entry is not None), None)
        if first is None:
            return result  # nothing to tie an anchor into: the chains stay as upstream leaves them
        held, anchors = book[3], []
        for name in _METADATA:
            current = getattr(self, name, None)
            if current is None:
                held.pop(name, None)
                continue
            mine = held.get(name)
            if mine is not None and mine[0] is current and type(steps) is int:
                anchor, total = mine[1], mine[2] + steps
                on_cache = anchor - total
            else:
                anchor, total = handle(current), 0
                on_cache = handle(anchor)
                anchors.append(anchor)
            setattr(self, name, on_cache)
            held[name] = (on_cache, anchor, total)
        if anchors:
            entries[first] = tie(entries[first], anchors)
        return result

    return advance


def advance_growth(arrays_cache: type) -> Finding:
    """A recurrent layer's cache: each step reads the old state, stores a new one, advances; only the
    states are evaluated (the layer's output depends on them, never on left_padding/lengths)."""
    import mlx.core as mx

    cache = arrays_cache(2, left_padding=[2, 0])
    cache.prepare(lengths=[3, 5])
    cache[0], cache[1] = mx.zeros((2, 3, 4)), mx.zeros((2, 4, 4))
    xs = mx.random.normal((200, 2, 1, 4), key=mx.random.key(0))
    mx.eval(cache.cache, xs)
    edges = {}
    for i in range(200):
        cache[0] = mx.concatenate([cache[0][:, 1:], xs[i]], axis=1)
        cache[1] = cache[1] * 0.5 + cache[0].sum(axis=1, keepdims=True)
        cache.advance(1)
        mx.eval(cache[0], cache[1])
        if i + 1 in (20, 200):
            edges[i + 1] = (graph_edges(cache.left_padding), graph_edges(cache.lengths))
    values = (cache.left_padding.tolist(), cache.lengths.tolist())
    expected = ([2 - 200, 0 - 200], [3 - 200, 5 - 200])
    detail = f"left_padding/lengths graph edges after 20 steps: {edges[20]}, after 200: {edges[200]}"
    if values != expected:
        return Finding(True, f"{detail}; values {values}, expected {expected}")
    if edges[200][0] > edges[20][0] or edges[200][1] > edges[20][1]:
        return Finding(True, f"{detail} (unbounded)")
    return Finding(False, f"{detail} (bounded)")


def anchored_ties(arrays_cache: type, steps: int = 60) -> tuple[list[int], Any, Any]:
    """A recurrent layer's cache decoded ``steps`` steps (state read, new state stored, ``advance(1)``, state
    evaluated): the steps whose state entry carried a ``Depends`` node when evaluated, and the final
    ``left_padding`` and ``lengths`` (as lists). Unpatched: no step; ``rebase_advance``: the anchoring only."""
    import io

    import mlx.core as mx

    cache = arrays_cache(1, left_padding=[4, 1])
    cache.prepare(lengths=[6, 9])
    cache[0] = mx.zeros((2, 3))
    mx.eval(cache[0])
    tied = []
    for step in range(1, steps + 1):
        cache[0] = cache[0] * 0.5 + 1
        cache.advance(1)
        dot = io.StringIO()
        mx.export_to_dot(dot, cache[0])
        if "Depends" in dot.getvalue():
            tied.append(step)
        mx.eval(cache[0])
    return tied, cache.left_padding, cache.lengths


def combined_make_mask(original: Any) -> Any:
    """``ArraysCache.make_mask`` that also applies the ``lengths`` (right padding) mask when left padding is set.

    The original returns ``arange(N) >= left_padding`` alone whenever ``left_padding`` is set; a row's
    positions at or past its length are then valid and its pad tokens update the recurrent state. The
    replacement ANDs ``arange(N) < lengths`` into that mask, as mlx-lm 0.32.0 does. With only one of the
    two set (or neither) the original's result is returned as it is. Lazy, no host synchronisation.
    """
    import mlx.core as mx

    def make_mask(self: Any, N: int, *args: Any, **kwargs: Any) -> Any:
        mask = original(self, N, *args, **kwargs)
        lengths = self.lengths
        if lengths is None or mask is None or self.left_padding is None:
            return mask
        return mask & (mx.arange(N) < lengths[:, None])

    return make_mask


def mask_drops_lengths(arrays_cache: type) -> Finding:
    """A left-padded, right-padded prefill chunk: rows ``[pad, a, b, c, d]`` (left padding 1, length 5) and
    ``[e, f, g, pad, pad]`` (length 3). The mask must exclude both kinds of padding."""
    cache = arrays_cache(1, left_padding=[1, 0])
    cache.prepare(lengths=[5, 3])
    mask = cache.make_mask(5)
    got = None if mask is None else mask.tolist()
    expected = [[False, True, True, True, True], [True, True, True, False, False]]
    if got == expected:
        return Finding(False, f"make_mask(5) with left_padding=[1, 0], lengths=[5, 3] masks both paddings: {got}")
    return Finding(
        True,
        f"make_mask(5) with left_padding=[1, 0], lengths=[5, 3] gives {got}, expected {expected}: "
        "right-padded positions stay valid, so pad tokens update the recurrent state",
    )
