"""Where a hot-path patch's decode cost goes: graph building on the host vs evaluation (a probe, run by hand).

``bench_gpu.py``'s models driven directly (no BatchGenerator): batch caches (``BatchKVCache`` per layer,
``ArraysCache`` for the hybrid's conv layers, as ``model.make_cache()`` gives them, left padding 0), a 32-token
prefill, then greedy decode steps. Each step is timed in two parts: the host time of ``model(...)`` (building the
graph, where a replacement's Python runs) and the time of evaluating the next token (the device's work and the
launches, waited for). The patches go out and back in between blocks as in ``bench_gpu.py --interleave 20
--settle 11``; medians per side::

    USE_TORCH=0 python scripts/probe_decode_split.py [--model llama] [--batch 1] [--patch offset-detach] [--blocks 200]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx
import mlx_lm.generate  # noqa: F401  (the cache module: the engine installs its patches on this import)
from _bench import hot_path_ids
from bench_gpu import build
from mlx_lm.models.cache import ArraysCache, BatchKVCache

import kvpatch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--patch", action="append", default=None)
    parser.add_argument("--blocks", type=int, default=200)
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    engine = kvpatch.get_engine()
    ids = hot_path_ids(engine, args.patch)
    print(f"{mx.default_device()}; toggled: {', '.join(ids)}; {args.model} batch {args.batch}", flush=True)
    model = build(args.model, args.small)
    gc.collect()
    gc.freeze()
    caches = []
    for cache in model.make_cache():
        if isinstance(cache, ArraysCache):
            caches.append(ArraysCache(len(cache.cache), left_padding=[0] * args.batch))
        else:
            caches.append(BatchKVCache([0] * args.batch))
    prompt = mx.random.randint(1, 30000, (args.batch, 32))
    y = mx.argmax(model(prompt, cache=caches)[:, -1], axis=-1)
    mx.eval(y)
    times: dict[str, tuple[list[float], list[float]]] = {"patched": ([], []), "unpatched": ([], [])}
    for block in range(args.blocks):
        side = "patched" if (block // 2 + block) % 2 else "unpatched"  # alternating, each side first in turn
        with contextlib.nullcontext() if side == "patched" else engine.without(*ids):
            for i in range(31):
                start = time.perf_counter()
                logits = model(y[:, None], cache=caches)
                mid = time.perf_counter()
                y = mx.argmax(logits[:, -1], axis=-1)
                mx.eval(y)
                end = time.perf_counter()
                if i >= 11:
                    times[side][0].append((mid - start) * 1e6)
                    times[side][1].append((end - mid) * 1e6)
    for side, (built, evaluated) in times.items():
        print(
            f"{side:>9}: per step, building {statistics.median(built):.1f} us, evaluating "
            f"{statistics.median(evaluated):.1f} us (medians of {len(built)} steps)",
            flush=True,
        )


if __name__ == "__main__":
    main()
