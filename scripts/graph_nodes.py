"""What kvpatch's hot-path patches add to each decode step's graph: mlx nodes by operation, patched against
unpatched, counted with ``mx.export_to_dot`` on every graph mlx-lm's ``BatchGenerator`` hands to
``mx.async_eval`` (CPU is enough: the graph is the same on every backend).

Prints, for each side, the nodes per step, then the steps whose patched graph differs from the first step's
and by which operations. Usage (inside a bucket, e.g. vlm-0.7.10)::

    python scripts/graph_nodes.py [--model hybrid|llama] [--batch 8] [--steps 30]
    python scripts/graph_nodes.py --batch 1 --steps 240 --interleave 20 --settle 11

With ``--interleave K`` it follows ``bench_gpu.py --interleave K --settle S`` instead (the patches switched out
and back in around each block, S unclocked steps, then K counted) and prints the nodes of each timed block by
side. Hybrid, batch 1 (vlm-0.7.10 bucket, 2026-11-26, arrays-advance-detach's earlier version, which anchored
its books every 10th call): with S = 11 patched blocks held 31,190 nodes and unpatched 31,180; with S = 10 the
patched blocks after the first held 843-903 more, all in their first step (the anchoring that evaluated the chain
the unpatched block left). docs/performance.md has the current figures.

The models are ``bench_gpu.py``'s at hidden 256.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import hot_path_ids
from bench_gpu import _prefilled, _prompts, build

import kvpatch
from kvpatch.patches._lazy import EVERY

_OP = re.compile(r'label ="([A-Za-z0-9_]+)[^"]*", shape=rectangle')


def _ops(args: tuple[Any, ...]) -> list[str]:
    """The operation of every node in the graph of the arrays ``mx.async_eval`` was given (bare or in lists)."""
    import mlx.core as mx

    arrays = [a for a in args if isinstance(a, mx.array)]
    for a in args:
        if isinstance(a, (list, tuple)):
            arrays += [x for x in a if isinstance(x, mx.array)]
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return _OP.findall(dot.getvalue())


def count_steps(model: Any, batch: int, steps: int) -> list[collections.Counter[str]]:
    """Operations of each graph ``BatchGenerator`` evaluates asynchronously over ``steps`` decode steps."""
    import mlx.core as mx

    counts: list[collections.Counter[str]] = []
    real = mx.async_eval

    def spy(*args: Any) -> Any:
        counts.append(collections.Counter(_ops(args)))
        return real(*args)

    _, step = _prefilled(model, _prompts(batch), steps + 10)
    mx.async_eval = spy
    try:
        for _ in range(steps):
            step()
    finally:
        mx.async_eval = real
    return counts


def count_interleaved(
    model: Any, batch: int, steps: int, engine: Any, ids: list[str], block: int, settle: int
) -> dict[str, list[int]]:
    """``bench_gpu.py --interleave``'s schedule on one generation (settling steps, then a timed block, the
    patches switched out and back in): nodes per step of the timed blocks, by side."""
    import mlx.core as mx

    timed: dict[str, list[int]] = {"patched": [], "unpatched": []}
    real = mx.async_eval
    current: list[list[int] | None] = [None]

    def spy(*args: Any) -> Any:
        if current[0] is not None:
            current[0].append(len(_ops(args)))
        return real(*args)

    _, step = _prefilled(model, _prompts(batch), steps + 10)
    mx.async_eval = spy
    try:
        done, k = 0, 0
        while done + settle + block <= steps:
            patched = k % 2 == 0
            with contextlib.ExitStack() as stack:
                if not patched:
                    stack.enter_context(engine.without(*ids))
                current[0] = None
                for _ in range(settle):
                    step()
                current[0] = timed["patched" if patched else "unpatched"]
                for _ in range(block):
                    step()
                current[0] = None
            done, k = done + settle + block, k + 1
    finally:
        mx.async_eval = real
    return timed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="hybrid", choices=("hybrid", "llama"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--interleave", type=int, default=0, metavar="K", help="bench_gpu.py's schedule: timed blocks of K steps"
    )
    parser.add_argument(
        "--settle", type=int, default=EVERY + 1, metavar="S", help="with --interleave: unclocked steps (bench_gpu's)"
    )
    args = parser.parse_args()

    import mlx_lm.generate  # noqa: F401  (the cache module: the engine installs its patches)

    engine = kvpatch.get_engine()
    ids = hot_path_ids(engine)
    print(f"hot-path patches installed: {', '.join(ids) or 'none'}")
    model = build(args.model, small=True)
    if args.interleave:
        timed = count_interleaved(model, args.batch, args.steps, engine, ids, args.interleave, args.settle)
        for name, nodes in timed.items():
            per_block = [sum(nodes[i : i + args.interleave]) for i in range(0, len(nodes), args.interleave)]
            print(f"{name:>9} timed blocks: nodes per block {per_block}, per step {min(nodes)}-{max(nodes)}")
        return 0
    sides = {}
    for name, ctx in (("unpatched", engine.without(*ids)), ("patched", contextlib.nullcontext())):
        with ctx:
            sides[name] = count_steps(model, args.batch, args.steps)
        print(f"{name:>9}: nodes per step {[sum(c.values()) for c in sides[name]]}")
    base = sides["unpatched"][0]
    for name, counts in sides.items():
        for i, c in enumerate(counts):
            diff = {op: c[op] - base[op] for op in sorted(set(c) | set(base)) if c[op] != base[op]}
            if diff:
                print(f"{name} step {i + 1}: {diff}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
