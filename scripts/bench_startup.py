"""Start-up costs of kvpatch, measured side by side (a benchmark, not a test).

1. A Python process that imports neither mlx-lm nor mlx-vlm, in a venv with kvpatch installed
   against an identical venv without it.
2. ``import mlx_lm`` / ``import mlx_vlm`` with kvpatch active against ``KVPATCH=off``, in the same
   interpreter and environment (run this with the upstream on the path, e.g. inside a matrix bucket).
3. ``python -m kvpatch status`` (no ``--verify``).

Runs alternate between the two sides; medians are reported. Usage::

    python scripts/bench_startup.py [--runs 30] [--python PY]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _time(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(
        cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir()
    )
    return time.perf_counter() - start


def compare(label: str, a: tuple[list[str], dict[str, str]], b: tuple[list[str], dict[str, str]], runs: int) -> None:
    ta: list[float] = []
    tb: list[float] = []
    _time(*a), _time(*b)  # warm the file cache
    for _ in range(runs):
        ta.append(_time(*a))
        tb.append(_time(*b))
    ma, mb = statistics.median(ta), statistics.median(tb)
    print(
        f"{label}: with kvpatch {ma * 1000:.1f} ms, without {mb * 1000:.1f} ms, ratio {ma / mb:.3f} (median of {runs})"
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--python", default=sys.executable, help="interpreter of an environment with kvpatch installed")
    args = parser.parse_args()
    env = dict(os.environ)
    env.pop("KVPATCH", None)
    off = dict(env, KVPATCH="off")

    with tempfile.TemporaryDirectory() as tmp:
        bare, withkv = Path(tmp) / "bare", Path(tmp) / "with"
        for venv in (bare, withkv):
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        site = subprocess.run(
            [str(withkv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        subprocess.run(
            [args.python, "-m", "pip", "install", "-q", "--no-deps", "--target", site, str(REPO)],
            check=True,
        )
        compare(
            "plain process (python -c pass)",
            ([str(withkv / "bin" / "python"), "-c", "pass"], env),
            ([str(bare / "bin" / "python"), "-c", "pass"], env),
            args.runs,
        )

    for pkg in ("mlx_lm", "mlx_vlm"):
        probe = subprocess.run([args.python, "-c", f"import {pkg}"], env=env, capture_output=True)
        if probe.returncode != 0:
            print(f"import {pkg}: not importable here, skipped")
            continue
        compare(
            f"import {pkg}",
            ([args.python, "-c", f"import {pkg}"], env),
            ([args.python, "-c", f"import {pkg}"], off),
            max(5, args.runs // 3),
        )
    ts = [_time([args.python, "-m", "kvpatch", "status"], env) for _ in range(max(5, args.runs // 3))]
    print(f"python -m kvpatch status: median {statistics.median(ts) * 1000:.0f} ms, max {max(ts) * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
