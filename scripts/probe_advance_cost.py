"""What arrays-advance-detach costs the host per decode step (a probe, run by hand inside a bucket or on a GPU host).

A decode step of ``bench_gpu.py``'s hybrid calls ``ArraysCache.advance(1)`` on 11 caches (its conv layers), each
with ``left_padding`` and ``lengths`` set (``BatchGenerator``), and the model evaluates one cache's
``left_padding`` (the one its SSM mask is built from). This probe does just that, with nothing else, and times
the host: microseconds per step by the step's place in a 10-step cycle (the period of the patch's earlier
versions, kept so that a periodic cost would show), patched and unpatched, in one process, and the time to discard
the caches afterwards. Upstream's ``-=`` adds one lazy node per attribute per step and frees the chains it leaves
in the unread caches only when the caches are discarded (the leak). The patch defers the decrements to Python
integers, so the unread caches build no node and the read one builds one subtraction per step, as upstream does.
On a GPU the decode step is short enough for this host time to show in
tokens/s (docs/performance.md has the figures)::

    .venv/bin/python scripts/in_bucket.py vlm-0.7.10 -- python -P scripts/probe_advance_cost.py
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

LAYERS = 11
PERIOD = 10
STEPS = 500


def caches() -> list[ArraysCache]:
    made = []
    for _ in range(LAYERS):
        cache = ArraysCache(2, left_padding=[0, 3])
        cache.prepare(lengths=[40, 37])
        cache[0], cache[1] = mx.zeros((2, 3, 8)), mx.zeros((2, 4, 4))
        made.append(cache)
    mx.eval([(c.cache, c.left_padding, c.lengths) for c in made])
    return made


def step_us(steps: int) -> tuple[list[float], float, Any]:
    """Host microseconds of each step's advances (after 20 unclocked steps), one fresh set of caches; of
    discarding the caches afterwards (what a finished generation does); and one unread cache's final
    ``left_padding`` and ``lengths`` (read after the clock, to compare designs)."""
    made = caches()
    times = []
    for i in range(20 + steps):
        start = time.perf_counter()
        for cache in made:
            cache.advance(1)
        if i >= 20:
            times.append((time.perf_counter() - start) * 1e6)
        mx.eval(made[0].left_padding)  # what the model reads
    values = (made[-1].left_padding.tolist(), made[-1].lengths.tolist())
    start = time.perf_counter()
    del made
    return times, (time.perf_counter() - start) * 1e6, values


def main() -> None:
    engine = kvpatch.get_engine()
    print(f"{mx.default_device()}; arrays-advance-detach: {engine.status['arrays-advance-detach'].state.value}")
    gc.collect()
    gc.freeze()
    sides: dict[str, list[tuple[list[float], float, Any]]] = {"patched": [], "unpatched": []}
    for r in range(20):
        for side in ("patched", "unpatched") if r % 2 else ("unpatched", "patched"):
            if side == "patched":
                sides[side].append(step_us(STEPS))
            else:
                with engine.without("arrays-advance-detach"):
                    sides[side].append(step_us(STEPS))
    for side, runs in sides.items():
        steps = [t for run, _, _ in runs for t in run]
        by_place = [statistics.median(steps[k::PERIOD]) for k in range(PERIOD)]
        mean = statistics.fmean(by_place)
        teardown = statistics.median(t for _, t, _ in runs)
        print(
            f"{side:>9}: {LAYERS} advances per step, host us by place in the 10-step cycle (medians) "
            f"{[round(t, 1) for t in by_place]}; mean of those {mean:.1f}; discarding the caches after "
            f"{STEPS} steps {teardown:.0f} us; per step with that {mean + teardown / STEPS:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
