"""The tree is ruff-clean (lint and format)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from support import REPO

RUFF = shutil.which("ruff")


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed")
@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(args):
    proc = subprocess.run([RUFF, *args, "kvpatch", "tests", "scripts"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


MYPY = shutil.which("mypy")


@pytest.mark.skipif(MYPY is None, reason="mypy is not installed")
def test_mypy_engine():
    """kvpatch ships py.typed: its engine type-checks."""
    proc = subprocess.run([MYPY], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_test_modules_have_distinct_names():
    """pytest imports test modules by basename (rootdir-relative folders without ``__init__.py``): two test files
    of the same name cannot be collected in one session, which is what a host with mlx installed runs
    (tests/upstream and tests/coexist next to tests/engine)."""
    seen: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}
