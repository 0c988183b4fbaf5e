"""Shared fixtures. ``run_py`` runs Python code in a fresh interpreter (the way users' processes start)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support import child_env, verdicts_dir

# kvpatch in this process (and every child, through child_env) keeps its verdicts in the session's own cache and
# starts no background verification: tests never touch the environment's verdict cache.
os.environ["KVPATCH_VERDICTS"] = verdicts_dir()
os.environ.setdefault("KVPATCH_VERIFY", "never")


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
