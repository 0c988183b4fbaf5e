"""A design probe for arrays-advance-detach's next version: ArraysCache metadata whose decrements stay pending.

Not a patch, and not installed by anything: this script alone, in its own process, swaps the design in and out
and times it against upstream. ``left_padding`` and ``lengths`` become data descriptors on ``ArraysCache``;
``advance`` calls upstream's with both hidden (so it builds no node) and adds ``N`` to a Python integer per
attribute; reading an attribute applies the pending total as one subtraction. Caches the model never reads
then build no lazy nodes at all, and the one it reads builds one per step, as upstream does. Timed like
``probe_advance_cost.py`` (11 caches, one read per step, 500 steps), with kvpatch's own patch taken out::

    .venv/bin/python scripts/in_bucket.py vlm-0.7.10 -- python -P scripts/probe_lazy_metadata.py

On this project's 2-core CPU (2026-11-26, three runs while a CI run shared it): upstream 42.6-72.8 us per step
and 21.9-36.7 ms to discard the caches afterwards; the pending design 11.5-17.4 us per step and 0.12-0.18 ms;
the same values after 500 steps (kvpatch's current patch, by ``probe_advance_cost.py`` on the same machine:
~110 us per step, 0.9 ms to discard). A real patch also needs every pending total applied before the
descriptors are taken out (a restore hook the engine does not have yet), and mlx-vlm's own ArraysCache
(0.6.4+) the same way.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import mlx.core as mx
import mlx_lm.generate  # noqa: F401  (the cache module: the engine installs its patches on this import)
from mlx_lm.models.cache import ArraysCache

import kvpatch

LAYERS, STEPS = 11, 500


class Pending:
    """A data descriptor: the stored array, minus the decrements ``advance`` left pending, applied on read."""

    def __init__(self, name: str) -> None:
        self.name, self.pending = name, f"_probe_pending_{name}"

    def __get__(self, obj: Any, cls: Any = None) -> Any:
        if obj is None:
            return self
        state = obj.__dict__
        value, pending = state.get(self.name), state.get(self.pending)
        if pending and value is not None:
            value = state[self.name] = value - pending
            state[self.pending] = 0
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value
        obj.__dict__[self.pending] = 0


def pending_advance(original: Any) -> Any:
    padding, lengths = Pending("left_padding").pending, Pending("lengths").pending

    def advance(self: Any, N: int) -> Any:
        state = self.__dict__
        kept_padding, kept_lengths = state.get("left_padding"), state.get("lengths")
        state["left_padding"] = state["lengths"] = None
        try:
            return original(self, N)
        finally:
            state["left_padding"], state["lengths"] = kept_padding, kept_lengths
            if kept_padding is not None:
                state[padding] = state.get(padding, 0) + N
            if kept_lengths is not None:
                state[lengths] = state.get(lengths, 0) + N

    return advance


def run() -> tuple[float, float, Any]:
    """Mean host us per step of 11 advances, us to discard the caches, and one cache's final metadata."""
    made = []
    for _ in range(LAYERS):
        cache = ArraysCache(2, left_padding=[0, 3])
        cache.prepare(lengths=[40, 37])
        cache[0], cache[1] = mx.zeros((2, 3, 8)), mx.zeros((2, 4, 4))
        made.append(cache)
    mx.eval([(c.cache, c.left_padding, c.lengths) for c in made])
    times = []
    for i in range(20 + STEPS):
        start = time.perf_counter()
        for cache in made:
            cache.advance(1)
        if i >= 20:
            times.append((time.perf_counter() - start) * 1e6)
        mx.eval(made[0].left_padding)  # what the model reads
    values = (made[5].left_padding.tolist(), made[5].lengths.tolist())
    start = time.perf_counter()
    del made
    return statistics.fmean(times), (time.perf_counter() - start) * 1e6, values


def main() -> None:
    engine = kvpatch.get_engine()
    gc.collect()
    gc.freeze()
    results: dict[str, list[tuple[float, float, Any]]] = {"upstream": [], "pending": []}
    with engine.without("arrays-advance-detach"):
        original = ArraysCache.advance
        for _ in range(10):
            results["upstream"].append(run())
            ArraysCache.left_padding = Pending("left_padding")  # type: ignore[attr-defined]
            ArraysCache.lengths = Pending("lengths")  # type: ignore[attr-defined]
            ArraysCache.advance = pending_advance(original)  # type: ignore[method-assign]
            try:
                results["pending"].append(run())
            finally:
                del ArraysCache.left_padding, ArraysCache.lengths  # type: ignore[attr-defined]
                ArraysCache.advance = original  # type: ignore[method-assign]
    for name, runs in results.items():
        print(
            f"{name:>8}: {LAYERS} advances {statistics.median(r[0] for r in runs):.1f} us per step, "
            f"discarding the caches after {STEPS} steps {statistics.median(r[1] for r in runs):.0f} us, "
            f"final metadata of one cache {runs[0][2]}",
            flush=True,
        )


if __name__ == "__main__":
    main()
