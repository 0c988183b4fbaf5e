"""Shared by the offset-detach family: tying lazy cache metadata into the graph, and measuring a graph.

Not a patch unit (the registry skips modules whose name starts with ``_``). Imports mlx lazily.
"""

from __future__ import annotations

from typing import Any

#: The offset-detach family ties lazy cache metadata into the graph once every EVERY steps, not every step: the
#: pending chain then holds at most EVERY steps' updates (5 graph edges each), whatever the number of steps,
#: and the per-call cost of the tie (one graph node, ~3 us of CPU time) is paid once per EVERY calls. 10 keeps
#: the graph under :data:`MAX_EDGES` and lines up with the step counts the reproductions measure at.
EVERY = 10
#: The most edges a metadata array's pending graph reaches with ties every EVERY steps (tests check this).
MAX_EDGES = 7 * EVERY + 10  # 5 edges a step, 7 with offset-rebind stacked on the same method (measured)


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
