"""Shared fixtures. ``run_py`` runs Python code in a fresh interpreter (the way users' processes start)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("KVPATCH") or k in ("KVPATCH_CACHE", "KVPATCH_BUCKET")
    }
    env.update(extra or {})
    return env


@pytest.fixture
def run_py(tmp_path):
    """Run ``code`` with ``python -c`` from an empty directory; return stdout; fail with stderr."""

    def run(code: str, env: dict[str, str] | None = None, check: bool = True) -> str:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env=child_env(env),
            capture_output=True,
            text=True,
            timeout=600,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout + ("" if check else proc.stderr)

    return run
