"""Where arrays-advance-detach's decode cost comes from (a probe, run by hand inside a bucket).

A two-entry ``ArraysCache`` with left padding, advanced one step at a time while a stand-in conv layer rewrites
and evaluates its state each step, timed three ways: with the patch (the metadata is tied into the state every
10th step, so it is evaluated with it), without it (upstream: the per-step decrements stay lazy and are never
evaluated), and without it plus an explicit ``mx.eval`` of ``left_padding`` every 10th step (what any fix that
keeps the graph bounded must pay at least)::

    .venv/bin/python scripts/in_bucket.py vlm-0.7.10 -- python scripts/probe_advance_cost.py
"""

from __future__ import annotations

import time

import mlx.core as mx
import mlx_lm  # noqa: F401  (the engine installs its patches on this import)
from mlx_lm.models.cache import ArraysCache

import kvpatch


def per_step_us(mode: str, steps: int = 3000) -> float:
    cache = ArraysCache(2, left_padding=[3, 1])
    cache[0] = mx.zeros((4, 3, 64))
    cache[1] = mx.zeros((4, 64))
    mx.eval(cache.cache)
    start = time.perf_counter()
    for i in range(steps):
        cache.advance(1)
        cache[0] = cache[0] * 1.0001 + 1  # what a conv layer does with its state each step
        if mode == "eval-metadata" and i % 10 == 9:
            mx.eval(cache.left_padding)
        mx.eval(cache[0])
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    engine = kvpatch.get_engine()
    for _ in range(3):
        patched = per_step_us("patched")
        with engine.without("arrays-advance-detach"):
            unpatched = per_step_us("unpatched")
            evaluated = per_step_us("eval-metadata")
        print(
            f"per step: patched {patched:.1f} us, unpatched {unpatched:.1f} us, "
            f"unpatched + eval(left_padding) every 10th {evaluated:.1f} us",
            flush=True,
        )


if __name__ == "__main__":
    main()
