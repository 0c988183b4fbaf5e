"""``scripts/gpu_suite.py``: the GPU suite's split (every test file in exactly one part, the same split every time)
and the summary of the parts' junit XML (counts, failures, skip reasons grouped, planned files no part reported)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_suite.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def files(part: str) -> list[str]:
    proc = run("files", part)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_every_test_file_is_in_exactly_one_part_and_the_split_is_stable():
    parts = [files(f"{k}/3") for k in (1, 2, 3)]
    every = sorted(
        str(p.relative_to(SCRIPT.parents[1]).as_posix()) for p in (SCRIPT.parents[1] / "tests").rglob("test_*.py")
    )
    assert sorted(f for part in parts for f in part) == every
    assert all(parts), parts
    assert files("2/3") == parts[1]
    assert run("files", "4/3").returncode != 0


def test_summary_counts_groups_skips_and_names_what_no_part_reported(tmp_path: Path):
    planned = files("1/2")
    reported, lost = planned[0], planned[1:]
    module = reported.removesuffix(".py").replace("/", ".")
    (tmp_path / "suite-1-of-2.xml").write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
        f'<testcase classname="{module}" name="test_a" time="1.5"/>'
        f'<testcase classname="{module}" name="test_b" time="0.5"><failure message="assert 1 == 2">x</failure>'
        "</testcase>"
        f'<testcase classname="{module}" name="test_c" time="0"><skipped type="pytest.skip" '
        'message="/x/y.py:3: needs mlx-vlm">/x/y.py:3: needs mlx-vlm</skipped></testcase>'
        f'<testcase classname="{module}" name="test_d" time="0"><skipped type="pytest.skip" '
        'message="/x/z.py:9: needs mlx-vlm">/x/z.py:9: needs mlx-vlm</skipped></testcase>'
        "</testsuite></testsuites>"
    )
    proc = run("summary", str(tmp_path))
    assert proc.returncode == 1, proc.stdout  # a failure, and planned files nobody reported
    out = proc.stdout
    assert "4 tests: 1 failed, 1 passed, 2 skipped" in out, out
    assert f"{reported}::test_b: assert 1 == 2" in out, out
    assert "     2  needs mlx-vlm" in out, out
    assert f"{len(lost)} planned test file(s) reported by no part" in out and all(f in out for f in lost), out
