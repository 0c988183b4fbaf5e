"""Shared by the offset-detach family: tying lazy cache metadata into the graph, and measuring a graph.

Not a patch unit (units live in the distribution folders). Imports mlx lazily.
"""

from __future__ import annotations

import sys
from typing import Any

from kvpatch.record import Finding

#: The offset-detach family ties lazy cache metadata into the graph once every EVERY steps, not every step: the
#: pending chain then holds at most EVERY steps' updates (5 graph edges each), whatever the number of steps,
#: and the per-call cost of the tie (one graph node, ~3 us of CPU time) is paid once per EVERY calls. 10 keeps
#: the graph small and lines up with the step counts the reproductions measure at.
EVERY = 10
#: Where the reproductions of growth-tied caches compare the offset's graph: past the first buffer growth (at step
#: 254 after a 3-token prompt), then a multiple of both tie periods (EVERY and 256) later, so a fixed cache has
#: the same pending chain at both.
CHECKPOINTS = (300, 300 + 1280)
#: Where a growth tie (:func:`growth_tie`) keeps the last buffer it tied: (``id`` of the keys, write position).
TIED = "_kvpatch_tied"


def tie(mx: Any) -> Any:
    """``tie(x, deps) -> x`` made to depend on ``deps``, decided once for the installed mlx.

    ``mx.depends`` where mlx has it (0.29.2+); before that an exact 1 computed from the dependencies
    multiplies ``x``, which reads them without changing a value and without a host synchronisation.
    """
    depends = getattr(mx, "depends", None)
    if depends is not None:
        return depends

    def tie(x: Any, deps: Any) -> Any:
        deps = deps if isinstance(deps, (list, tuple)) else [deps]
        one = sum((d * 0).sum() for d in deps) + 1
        return x * one.astype(x.dtype)

    return tie


def graph_edges(array: Any) -> int:
    """Edges of the unevaluated graph behind ``array`` (0 once it is evaluated and detached)."""
    import io

    import mlx.core as mx

    buf = io.StringIO()
    mx.export_to_dot(buf, array)
    return buf.getvalue().count("->")


def growth_finding(detail: str, edges: dict[int, tuple[int, int]]) -> Finding:
    """The verdict on two metadata arrays' graph edges measured after 20 and 200 steps (``edges[steps]``): the
    bug is present when either graph grew between the two (unbounded)."""
    if edges[200][0] > edges[20][0] or edges[200][1] > edges[20][1]:
        return Finding(True, f"{detail} (unbounded)")
    return Finding(False, f"{detail} (bounded)")


class ClassValue(property):
    """A property that, read on the class itself rather than on an instance, gives ``value``: what the class
    attribute it stands in for held (upstream code reads ``BatchKVCache.step`` on the class, too)."""

    def __init__(self, fget: Any, fset: Any = None, fdel: Any = None, doc: str | None = None, *, value: Any) -> None:
        super().__init__(fget, fset, fdel, doc)
        self.value = value

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self.value
        return super().__get__(obj, objtype)


class _GrowthTie(ClassValue):
    """:func:`growth_tie`'s descriptor: the tie is made in ``__get__`` itself, so the frame that called it is the
    reader's."""

    def __init__(self, step: Any, join: Any) -> None:
        def get(obj: Any) -> Any:
            return obj.__dict__.get("step", step)

        def set(obj: Any, value: Any) -> None:
            obj.__dict__["step"] = value

        def delete(obj: Any) -> None:
            state = obj.__dict__
            if "step" not in state:
                raise AttributeError("step")
            del state["step"]

        super().__init__(get, set, delete, "``step``; reading it to grow the buffer ties the offset in", value=step)
        self.join = join

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self.value
        state = obj.__dict__
        keys = state.get("keys")
        if keys is not None and sys._getframe(1).f_code.co_name == "update_and_fetch":
            idx = state.get("_idx")
            if state.get(TIED) != (id(keys), idx):
                keys = state["keys"] = self.join(keys, obj.offset)
                state[TIED] = (id(keys), idx)
        return state.get("step", self.value)


def growth_tie(step: Any, mx: Any) -> ClassValue:
    """A data descriptor for a KV cache class's ``step`` (the class attribute, ``step`` its value) that ties the
    cache's ``offset`` into its keys buffer whenever ``update_and_fetch`` grows the buffer.

    ``update_and_fetch`` of the batch KV caches reads ``self.step`` only when the buffer must grow, before it
    concatenates the old keys with the new zeros. Reading ``step`` there, on an instance whose ``keys`` are set,
    makes them depend on the current ``offset`` (:func:`tie`, once per buffer: the reads that follow within the same
    growth find it done), so the grown buffer, which every later step writes into and the attention reads,
    evaluates the offset as it stood then. The pending chain is bounded by one buffer's worth of steps (``step``,
    256 tokens) and the per-token path runs no code of kvpatch's at all. Any other read (another method, another
    thread polling the cache) is pure: it returns the value and changes nothing, since a tie made there would
    leave an array of the reader's stream in the cache (mlx streams are per thread). The tie is the writer's: it is
    made where the reading frame is an ``update_and_fetch`` (upstream's, a subclass's or a vendored copy's), which
    also writes the cache on its own stream. The value read is the instance's own ``step`` if one was set, else
    ``step``; setting and deleting it on an instance work as on a plain attribute.
    """
    return _GrowthTie(step, tie(mx))


def serve_step(original: Any) -> Any:
    """Builder for a batch KV cache class's ``step`` target: the growth tie over the class attribute's value, or
    ``original`` itself (declined) where it is not the plain int this fix was written for."""
    import mlx.core as mx

    if type(original) is not int:
        return original
    return growth_tie(original, mx)


def growth_tied(original: Any, cls: Any) -> bool:
    """True when ``original`` (an ``update_and_fetch`` a builder received) is ``cls``'s own code and ``cls`` has the
    class attribute ``step`` that :func:`serve_step` serves: the growth tie covers it, so no wrapper is needed (a
    vendored copy's function, or a class that sets ``step`` per instance, is not covered)."""
    return isinstance(cls, type) and original.__module__ == cls.__module__ and "step" in vars(cls)
