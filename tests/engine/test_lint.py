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
    proc = subprocess.run(
        [RUFF, *args, "kvpatch", "patches", "tests", "scripts"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


MYPY = shutil.which("mypy")


@pytest.mark.skipif(MYPY is None, reason="mypy is not installed")
def test_mypy_engine():
    """kvpatch ships py.typed: its engine type-checks."""
    proc = subprocess.run([MYPY], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
