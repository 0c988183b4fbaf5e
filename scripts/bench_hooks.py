#!/usr/bin/env python3
"""What kvpatch costs inside ``import mlx_lm``: its own hook time, and whole processes against ``KVPATCH=off``.

    .venv/bin/python scripts/in_bucket.py lm-0.32.2 -- python scripts/bench_hooks.py --runs 20

1. ``--hook-runs`` fresh processes each build kvpatch's engine (``KVPATCH=off`` keeps the ``.pth`` bootstrap
   out), time every post-import hook kvpatch runs during ``import mlx_lm``, and report it with the patches'
   states and how many reproductions ran (must be 0). What the hooks do depends on the verdict cache
   (``KVPATCH_VERDICTS``): run ``python -m kvpatch verify`` first for a verified environment, or point it at
   an empty directory for a first use (``KVPATCH_VERIFY=never`` leaves out the background verification).
2. ``--runs`` pairs of fresh ``python -c "import mlx_lm"`` processes, kvpatch active and ``KVPATCH=off``
   alternating: medians of CPU time (user + system) and wall time, and their ratios.

On a shared machine single runs vary a lot; read the medians, and the CPU ratio before the wall ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HOOKS = r"""
import json, os, time
os.environ["KVPATCH"] = "off"
t0 = time.perf_counter()
import kvpatch
from kvpatch import registry
from kvpatch.config import Config
from kvpatch.engine import REPRODUCTIONS_RUN, Engine
spent = [0.0]
hook = Engine._hook
def timed(self, module):
    t = time.perf_counter()
    hook(self, module)
    spent[0] += time.perf_counter() - t
Engine._hook = timed
del os.environ["KVPATCH"]
engine = Engine(registry.load().patches, config=Config())
engine.activate()
t1 = time.perf_counter()
import mlx_lm
t2 = time.perf_counter()
states = {}
for p in engine.patches:
    state = engine.status[p.id].state.value
    states[state] = states.get(state, 0) + 1
print(json.dumps({"hooks_ms": round(spent[0] * 1000, 2), "import_ms": round((t2 - t1) * 1000, 1),
                  "states": states, "reproductions": len(REPRODUCTIONS_RUN)}))
"""


def hooks(runs: int) -> None:
    times = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", HOOKS], capture_output=True, text=True, check=True)
        data = json.loads(out.stdout.strip().splitlines()[-1])
        times.append(data["hooks_ms"])
        print(
            f"  hooks {data['hooks_ms']:7.2f} ms  import {data['import_ms']:7.1f} ms  {data['states']}  "
            f"reproductions run: {data['reproductions']}"
        )
    print(
        f"kvpatch hooks inside import mlx_lm: median {statistics.median(times):.2f} ms, "
        f"min {min(times):.2f}, max {max(times):.2f} ({runs} processes)"
    )


def one(off: bool) -> tuple[float, float]:
    env = dict(os.environ)
    if off:
        env["KVPATCH"] = "off"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import mlx_lm"], env=env, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def processes(runs: int) -> None:
    one(False), one(True)  # warm the file cache
    on, off = [], []
    for _ in range(runs):
        on.append(one(False))
        off.append(one(True))
    cpu_on, cpu_off = statistics.median(c for c, _ in on), statistics.median(c for c, _ in off)
    wall_on, wall_off = statistics.median(w for _, w in on), statistics.median(w for _, w in off)
    print(
        f"import mlx_lm, {runs} processes each: CPU {cpu_on * 1000:.0f} ms active / {cpu_off * 1000:.0f} ms off "
        f"= {cpu_on / cpu_off:.3f}; wall {wall_on * 1000:.0f} / {wall_off * 1000:.0f} ms = {wall_on / wall_off:.3f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hook-runs", type=int, default=7)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    if args.hook_runs:
        hooks(args.hook_runs)
    if args.runs:
        processes(args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
