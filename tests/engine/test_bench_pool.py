"""``scripts/bench_gpu.py --pool``: pairs of runs with one set of settings pooled per model and batch, runs that
differ refused with a clear message (the README's llama batch 8 row on the H100 is such a pool)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_gpu.py"
SETTINGS = dict(tokens=512, interleave=20, settle=11, small=False, tie_every=None, teardown=False, budget=160.0)
META = dict(device="Device(gpu, 0) TEST", mlx="0.32.4", mlx_lm="0.32.2", toggled=["offset-detach"])


def write(path: Path, ratios: list[float], **changes: object) -> str:
    settings = {**SETTINGS, **{k: v for k, v in changes.items() if k in SETTINGS}}
    meta = {**META, **{k: v for k, v in changes.items() if k in META}}
    conf = dict(model="llama", batch=8, on=[100.0 * r for r in ratios], off=[100.0] * len(ratios), steps=[])
    path.write_text(json.dumps(dict(settings=settings, **meta, configurations=[conf])))
    return str(path)


def pool(*paths: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--pool", *paths], capture_output=True, text=True, timeout=120)


def test_pool_joins_the_pairs_of_runs_with_one_setting(tmp_path: Path) -> None:
    # 40 pairs at 0.98 in one run, 41 at 1.02 in the other (with another budget, which does not change a pair):
    # alone each median is its own value; pooled, the median is the 41st of 81 sorted ratios, 1.02
    a = write(tmp_path / "a.json", [0.98] * 40)
    b = write(tmp_path / "b.json", [1.02] * 41, budget=420.0)
    done = pool(a, b)
    assert done.returncode == 0, done.stderr
    row = done.stdout.splitlines()
    assert "81 rounds" in row[1] and "a.json: 40; b.json: 41" in row[1], done.stdout
    assert row[2].split("median ratio ")[1].startswith("1.0200 [95% CI 0.9800, 1.0200]"), done.stdout
    alone = pool(a)
    assert alone.returncode == 0 and "median ratio 0.9800" in alone.stdout, alone.stdout + alone.stderr


def test_pool_refuses_runs_that_differ(tmp_path: Path) -> None:
    a = write(tmp_path / "a.json", [1.0] * 10)
    for change in (dict(settle=10), dict(device="Device(gpu, 0) OTHER"), dict(mlx_lm="0.32.1")):
        b = write(tmp_path / "b.json", [1.0] * 10, **change)
        done = pool(a, b)
        assert done.returncode == 2, done.stdout
        assert f"differ in {next(iter(change))}" in done.stderr and not done.stdout.strip(), done.stderr
    usage = pool()
    assert usage.returncode == 2 and "usage" in usage.stderr
    (tmp_path / "c.json").write_text("{}")
    for bad in (str(tmp_path / "missing.json"), str(tmp_path / "c.json")):
        done = pool(a, bad)
        assert done.returncode == 2 and f"cannot read {bad}" in done.stderr, done.stderr
