"""Start-up costs of kvpatch, measured side by side (a benchmark, not a test).

1. ``python -c pass`` (a process that imports neither mlx-lm nor mlx-vlm) in a venv with kvpatch
   installed against an identical venv without it, twice:
   - with bytecode: kvpatch installed as pip does by default (``.pyc`` compiled at install);
   - without bytecode: kvpatch installed with ``--no-compile`` (as uv installs by default) and both
     sides run with ``PYTHONDONTWRITEBYTECODE=1``, so every start compiles whatever kvpatch runs.
2. ``import mlx_lm`` / ``import mlx_vlm`` with kvpatch active against ``KVPATCH=off``, in the same
   interpreter and environment (run this with the upstream on the path, e.g. inside a matrix bucket:
   ``.venv/bin/python scripts/in_bucket.py vlm-0.7.10 -- python scripts/bench_startup.py``).
3. ``python -m kvpatch status`` (no ``--verify``).

Runs alternate between the two sides; the median and the minimum of each side are reported, of the
wall time and of the child's CPU time (user + system, from ``wait4``: on a shared machine it is less
disturbed by other load than the wall time, and the minimum is the least disturbed run). Usage::

    python scripts/bench_startup.py [--runs 200] [--import-runs 20] [--python PY] [--skip-imports]
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
WHAT = str(REPO)  # what to install (--wheel: a built wheel, for a machine without a package index)


def _time(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall time and the child's CPU time (user + system; less disturbed by other load) of one run."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir()
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return wall, usage.ru_utime + usage.ru_stime


def compare(label: str, a: tuple[list[str], dict[str, str]], b: tuple[list[str], dict[str, str]], runs: int) -> None:
    ta: list[tuple[float, float]] = []
    tb: list[tuple[float, float]] = []
    for _ in range(3):  # warm the file cache (and write bytecode where that is allowed)
        _time(*a), _time(*b)
    for i in range(runs):
        if i % 2:
            ta.append(_time(*a))
            tb.append(_time(*b))
        else:
            tb.append(_time(*b))
            ta.append(_time(*a))
    print(f"{label} ({runs} runs each, alternating):", flush=True)
    for what, k in (("wall", 0), ("cpu", 1)):
        xa, xb = [t[k] for t in ta], [t[k] for t in tb]
        ma, mb, na, nb = statistics.median(xa), statistics.median(xb), min(xa), min(xb)
        print(
            f"  {what}: with kvpatch median {ma * 1000:.2f} ms, min {na * 1000:.2f} ms; "
            f"without median {mb * 1000:.2f} ms, min {nb * 1000:.2f} ms; ratio median {ma / mb:.3f}, min {na / nb:.3f}",
            flush=True,
        )


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return path / "bin" / "python"


def _site(python: Path) -> str:
    return subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def _install(pip_python: str, site: str, *flags: str) -> None:
    subprocess.run(
        [pip_python, "-m", "pip", "install", "-q", "--no-deps", "--target", site, *flags, WHAT],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def plain_process(runs: int, pip_python: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPATCH", "PYTHON"))}
    nobc = dict(env, PYTHONDONTWRITEBYTECODE="1")
    with tempfile.TemporaryDirectory() as tmp:
        bare = _venv(Path(tmp) / "bare")
        compiled = _venv(Path(tmp) / "with-pyc")
        source_only = _venv(Path(tmp) / "with-no-pyc")
        _install(pip_python, _site(compiled))
        _install(pip_python, _site(source_only), "--no-compile")
        leftovers = list(Path(_site(source_only)).glob("__pycache__/_kvpatch*"))
        assert not leftovers, leftovers
        compare(
            "python -c pass, with bytecode",
            ([str(compiled), "-c", "pass"], env),
            ([str(bare), "-c", "pass"], env),
            runs,
        )
        compare(
            "python -c pass, no bytecode (--no-compile install, PYTHONDONTWRITEBYTECODE=1)",
            ([str(source_only), "-c", "pass"], nobc),
            ([str(bare), "-c", "pass"], nobc),
            runs,
        )


def imports(python: str, runs: int) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("KVPATCH", "KVPATCH_DISABLE", "KVPATCH_ENABLE")}
    off = dict(env, KVPATCH="off")
    for pkg in ("mlx_lm", "mlx_vlm"):
        probe = subprocess.run([python, "-c", f"import {pkg}"], env=env, capture_output=True)
        if probe.returncode != 0:
            print(f"import {pkg}: not importable here, skipped")
            continue
        compare(f"import {pkg}", ([python, "-c", f"import {pkg}"], env), ([python, "-c", f"import {pkg}"], off), runs)
    ts = [_time([python, "-m", "kvpatch", "status"], env)[0] for _ in range(runs)]
    print(
        f"python -m kvpatch status: median {statistics.median(ts) * 1000:.0f} ms, "
        f"min {min(ts) * 1000:.0f} ms ({runs} runs)"
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=200, help="runs of each side for python -c pass")
    parser.add_argument("--import-runs", type=int, default=20, help="runs of each side for the imports")
    parser.add_argument("--python", default=sys.executable, help="interpreter of an environment with kvpatch installed")
    parser.add_argument("--skip-imports", action="store_true", help="only the plain-process comparison")
    parser.add_argument("--skip-plain", action="store_true", help="only the imports and status")
    parser.add_argument("--wheel", help="install this kvpatch wheel instead of building the checkout")
    args = parser.parse_args()
    if args.wheel:
        global WHAT
        WHAT = args.wheel
    if not args.skip_plain:
        plain_process(args.runs, args.python)
    if not args.skip_imports:
        imports(args.python, args.import_runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
