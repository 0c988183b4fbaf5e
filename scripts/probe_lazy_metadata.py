"""A design probe for arrays-advance-detach's next version: ArraysCache metadata whose decrements stay pending.

Not a patch, and not installed by anything: this script alone, in its own process, swaps the design in and out
and times it against upstream. ``left_padding`` and ``lengths`` become data descriptors on ``ArraysCache``;
``advance`` calls upstream's with both hidden (so it builds no node) and adds ``N`` to a Python integer per
attribute; reading an attribute applies the pending total as one subtraction. Caches the model never reads
then build no lazy nodes at all, and the one it reads builds one per step, as upstream does. Timed with
``probe_advance_cost.py``'s caches and clock (11 caches, one read per step, 500 steps), with kvpatch's own
patch taken out::

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
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlx_lm.models.cache import ArraysCache
from probe_advance_cost import LAYERS, STEPS, step_us  # the same caches, steps and clock

import kvpatch

PENDING = "_probe_pending_"


class Pending:
    """A data descriptor: the stored array, minus the decrements ``advance`` left pending, applied on read."""

    def __init__(self, name: str) -> None:
        self.name, self.pending = name, PENDING + name

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
    padding, lengths = PENDING + "left_padding", PENDING + "lengths"

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


def _mean(measured: tuple[list[float], float, Any]) -> tuple[float, float, Any]:
    times, teardown, values = measured
    return statistics.fmean(times), teardown, values


def main() -> None:
    engine = kvpatch.get_engine()
    gc.collect()
    gc.freeze()
    results: dict[str, list[tuple[float, float, Any]]] = {"upstream": [], "pending": []}
    with engine.without("arrays-advance-detach"):
        original = ArraysCache.advance
        for _ in range(10):
            results["upstream"].append(_mean(step_us(STEPS)))
            ArraysCache.left_padding = Pending("left_padding")  # type: ignore[attr-defined]
            ArraysCache.lengths = Pending("lengths")  # type: ignore[attr-defined]
            ArraysCache.advance = pending_advance(original)  # type: ignore[method-assign]
            try:
                results["pending"].append(_mean(step_us(STEPS)))
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
