"""Shared by the ArraysCache patches of mlx-lm and mlx-vlm's own copy (mlx-vlm 0.6.4+): one bug, two classes.

* ``deferred_metadata`` / ``defer_advance`` / ``pickle_upstream_values`` / ``flush`` (arrays-advance-detach,
  vlm-arrays-advance-detach): ``advance`` decrements ``left_padding`` / ``lengths`` lazily and nothing evaluates
  them; ``advance_growth`` measures it.
* ``combined_make_mask``: ``make_mask`` returns only the left-padding mask when both ``left_padding`` and
  ``lengths`` are set (arrays-mask-lengths, vlm-arrays-mask-lengths); ``mask_drops_lengths`` measures it.

Not a patch unit (units live in the distribution folders). Imports mlx lazily.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from kvpatch.patches import _reproduce
from kvpatch.patches._lazy import graph_edges, growth_finding
from kvpatch.record import Finding, Patch, own_class

#: Deferred metadata lives in the cache's ``__dict__`` beside upstream's attribute, which keeps the array a writer
#: last stored (the *base*): PENDING + name holds ``(base, total)``, the Python sum of the ``N`` advanced since that
#: base was stored. One key, one tuple: every change is a single store, and a read that finds the entry computes
#: from it alone, so it sees a base and a total that belong together (another thread's included). The entry holds
#: its own base, so a ``__dict__`` copied or cloned value by value (mlx-vlm's inkling snapshots its ArraysCaches that
#: way for speculative restore) keeps its value.
PENDING = "_kvpatch_pending_"
_METADATA = ("left_padding", "lengths")
#: Caches whose decrements were deferred while a ``defer_advance`` was installed (weakly held): :func:`flush`.
_DEFERRED: weakref.WeakSet[Any] = weakref.WeakSet()


def vlm_own_arrays_cache() -> Any:
    """mlx-vlm's own ArraysCache class (0.6.4+), or None where ``mlx_vlm.models.cache`` has mlx-lm's."""
    import mlx_vlm.models.cache as vlm_cache

    return own_class(vlm_cache, "ArraysCache")


def _deferred_attribute(name: str, _: None) -> property:
    return deferred_metadata(name)


def declare_deferred(patch: Patch, module: str) -> None:
    """Declare ``patch``'s fix on ``module``'s ArraysCache: :func:`deferred_metadata` for ``left_padding`` and
    ``lengths``, :func:`defer_advance` around ``advance``."""
    for name in _METADATA:
        patch.add(module, f"ArraysCache.{name}")(functools.partial(_deferred_attribute, name))
    patch.replace(module, "ArraysCache.advance")(defer_advance)


def on_vlm_own_class(check: Callable[[Any], Finding], lm_twin: str) -> Finding:
    """``check`` run on mlx-vlm's own ArraysCache class; where there is none (mlx-lm's class, checked by
    ``lm_twin``, or no ``mlx_vlm.models.cache``) nothing to fix."""
    try:
        import mlx_vlm.models.cache  # noqa: F401
    except ImportError as exc:
        return _reproduce.absent(exc, "this mlx-vlm has no mlx_vlm.models.cache")
    cls = vlm_own_arrays_cache()
    if cls is None:
        return Finding(False, f"this mlx-vlm has no ArraysCache of its own (mlx-lm's class: {lm_twin})")
    return check(cls)


def deferred_metadata(name: str) -> property:
    """A data descriptor for ``left_padding`` / ``lengths`` on ArraysCache: the stored base minus the decrements
    :func:`defer_advance` deferred, computed afresh at every read (mlx-vlm 0.6.16's own ``ArraysCache`` reads its
    metadata the same way).

    A read is pure: it stores nothing, so an array it builds belongs to the reading thread alone (mlx streams are
    per thread: an array cached by one thread's read fails to evaluate in another). Its graph is one subtraction
    over what the last writer stored, however often it is read. Writers (``prepare``, ``filter``, ``extend``,
    ``merge``, ``state``, ``finalize``, ``__init__``) store a new base, then drop the entry, as assigning the
    attribute does upstream: a read in between computes the value from before the write.
    """
    pending_key = PENDING + name

    def get(self: Any) -> Any:
        state = self.__dict__
        pending = state.get(pending_key)
        if pending is not None:
            return pending[0] - pending[1]
        try:
            return state[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}") from None

    def set(self: Any, value: Any) -> None:
        state = self.__dict__
        state[name] = value
        state.pop(pending_key, None)

    def delete(self: Any) -> None:
        state = self.__dict__
        if name not in state:
            raise AttributeError(name)
        del state[name]
        state.pop(pending_key, None)

    return property(get, set, delete, f"``{name}``, with kvpatch's deferred decrements applied when read")


def defer_advance(original: Any) -> Any:
    """``ArraysCache.advance`` that defers the metadata's decrements to Python integers (with
    :func:`deferred_metadata` installed on the same class).

    The original's whole effect is ``lengths -= N`` then ``left_padding -= N`` where set (one lazy graph node
    each per call, and nothing reads them in most layers, so their chains grow without bound; its source is
    fingerprinted on every release in range, so a release where it does more is drift). The replacement makes
    the same two changes, in the same order, as one store each of ``(base, total + N)``: a reader never sees
    the attribute missing or ``None`` in between. A layer nobody reads builds no node at all; the one the model
    reads (its SSM mask) builds one subtraction per read. No host synchronisation, values identical (integer
    arithmetic). A non-integer ``N``, or a cache without the attributes, is left to the original (which then
    reads and writes through the descriptors, and raises where upstream raises).
    """
    deferred = _DEFERRED
    lengths_key, padding_key = PENDING + "lengths", PENDING + "left_padding"

    def advance(self: Any, N: Any) -> Any:
        state = self.__dict__
        try:
            lengths, padding = state["lengths"], state["left_padding"]
        except KeyError:
            return original(self, N)
        if type(N) is not int:
            return original(self, N)
        for value, key in ((lengths, lengths_key), (padding, padding_key)):  # upstream's order
            if value is None:
                continue
            pending = state.get(key)
            if pending is None:
                state[key] = (value, N)
                deferred.add(self)
            else:
                state[key] = (pending[0], pending[1] + N)

    return advance


def upstream_state(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of a cache's ``__dict__`` in upstream's form: each attribute holds its value with the deferred
    decrements applied (one lazy subtraction), and no key of kvpatch's is left."""
    out = {key: value for key, value in state.items() if not key.startswith(PENDING)}
    for name in _METADATA:
        pending = state.get(PENDING + name)
        if pending is not None:
            out[name] = pending[0] - pending[1]
    return out


def pickle_upstream_values(original: Any) -> Any:
    """``ArraysCache.__reduce_ex__`` (inherited from ``object`` upstream: the class pickles and copies through its
    ``__dict__``) whose state is :func:`upstream_state`: a pickle carries upstream's values only, so it loads
    right where kvpatch is absent or the patch is off, and ``copy.copy`` / ``copy.deepcopy`` (a server's prompt
    cache) give a copy whose attributes hold the current values. Anything else the original returns (a state that
    is not a plain ``__dict__`` with deferred decrements) is passed on as it is."""

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        reduced = original(self, protocol)
        if type(reduced) is not tuple or len(reduced) < 3 or type(reduced[2]) is not dict:
            return reduced
        state = reduced[2]
        if not any(key.startswith(PENDING) for key in state):
            return reduced
        return (*reduced[:2], upstream_state(state), *reduced[3:])

    # object's method has no __module__ for the engine to copy onto its replacement: the replacement has none either
    __reduce_ex__.__module__ = getattr(original, "__module__", None)  # type: ignore[assignment]
    return __reduce_ex__


def flush(cls: type) -> None:
    """Store every deferred total of ``cls``'s instances in upstream's form (``base - total`` in the attribute), for
    when the descriptors are taken out: caches that registered themselves, and any other instance the garbage
    collector knows of (a copy of a ``__dict__`` made by hand; one that is also frozen by ``gc.freeze`` and never
    advanced before the patch is taken out is not found)."""
    import gc

    found = {id(obj): obj for obj in list(_DEFERRED) if isinstance(obj, cls)}
    classes, todo = [], [cls]
    while todo:
        current = todo.pop()
        classes.append(current)
        todo.extend(current.__subclasses__())
    for obj in gc.get_referrers(*classes):
        if isinstance(obj, cls) and not isinstance(obj, type):
            found.setdefault(id(obj), obj)
    for obj in found.values():
        state = obj.__dict__
        for name in _METADATA:
            pending = state.pop(PENDING + name, None)
            if pending is not None:
                state[name] = pending[0] - pending[1]
        _DEFERRED.discard(obj)


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
    return growth_finding(detail, edges)


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
