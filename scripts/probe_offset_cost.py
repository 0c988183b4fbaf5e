"""What offset-detach costs per decode step, host and device (a probe, run by hand inside a bucket or on a GPU host).

A decode step of ``bench_gpu.py``'s llama calls ``BatchKVCache.update_and_fetch`` once per layer (16) with one new
token per row, and its attention reads the returned keys and values. This probe does just that, with nothing
else: per step, the host microseconds of the 16 calls (graph building only) and of evaluating what they return
(the device's work, waited for), patched and unpatched alternately in one process, by the step's place in the
patch's 10-step tie period::

    .venv/bin/python scripts/in_bucket.py vlm-0.7.10 -- python -P scripts/probe_offset_cost.py [--batch 8]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import mlx.core as mx
import mlx_lm.generate  # noqa: F401  (the cache module: the engine installs its patches on this import)
from mlx_lm.models.cache import BatchKVCache

import kvpatch
from kvpatch.patches._lazy import EVERY

LAYERS = 16


def run(batch: int, steps: int) -> tuple[list[float], list[float]]:
    """Host microseconds per step of the calls and of the evaluation (after 20 unclocked steps)."""
    caches = [BatchKVCache([0] * batch) for _ in range(LAYERS)]
    prompt = mx.zeros((batch, 8, 12, 64), dtype=mx.bfloat16)
    for cache in caches:
        cache.update_and_fetch(prompt, prompt)
    mx.eval([(c.keys, c.values, c.offset) for c in caches])
    new = mx.ones((batch, 8, 1, 64), dtype=mx.bfloat16)
    mx.eval(new)
    build, evaluate = [], []
    for i in range(20 + steps):
        start = time.perf_counter()
        out = [cache.update_and_fetch(new, new) for cache in caches]
        mid = time.perf_counter()
        mx.eval([k.sum() + v.sum() + cache.offset.sum() for (k, v), cache in zip(out, caches, strict=True)])
        end = time.perf_counter()
        if i >= 20:
            build.append((mid - start) * 1e6)
            evaluate.append((end - mid) * 1e6)
    return build, evaluate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    engine = kvpatch.get_engine()
    print(f"{mx.default_device()}; offset-detach: {engine.status['offset-detach'].state.value}; batch {args.batch}")
    gc.collect()
    gc.freeze()
    sides: dict[str, list[tuple[list[float], list[float]]]] = {"patched": [], "unpatched": []}
    for r in range(args.rounds):
        for side in ("patched", "unpatched") if r % 2 else ("unpatched", "patched"):
            if side == "patched":
                sides[side].append(run(args.batch, args.steps))
            else:
                with engine.without("offset-detach"):
                    sides[side].append(run(args.batch, args.steps))
    for side, runs in sides.items():
        for what, index in (("calls", 0), ("eval", 1)):
            steps = [t for run_ in runs for t in run_[index]]
            by_place = [statistics.median(steps[k::EVERY]) for k in range(EVERY)]
            print(
                f"{side:>9} {what:>5}: host us per step by place in the {EVERY}-step period (medians) "
                f"{[round(x, 1) for x in by_place]}; median {statistics.median(steps):.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
