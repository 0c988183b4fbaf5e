"""Helpers for the coexistence tests: kvpatch next to downstream servers' own monkey patches (vllm-mlx, Rapid-MLX).

They run inside the ``coexist-*`` buckets of ``tests/matrix.py`` (``tests/test_coexist.py`` drives them
when ``KVPATCH_COEXIST`` asks for it; by hand: ``scripts/in_bucket.py coexist-vllm-mlx -- python -m pytest
tests/coexist -q``). Elsewhere every test here is skipped: each needs its downstream distribution.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from support import child_env  # noqa: E402


def installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def needs(distribution: str) -> None:
    """Skip unless this bucket has ``distribution`` (and mlx-lm) installed."""
    if importlib.util.find_spec("mlx") is None or installed(distribution) is None:
        pytest.skip(f"needs {distribution} (runs inside the coexist buckets of tests/matrix.py)")


def run_scenario(*args: str, order: str, env: dict[str, str] | None = None, timeout: int = 900) -> dict:
    """Run ``scenarios.py`` in a fresh interpreter; return its RESULT json.

    ``server-first`` starts the child with ``KVPATCH=off`` (the bootstrap stays out; the scenario turns
    kvpatch on after the server's patches). ``max-kv-size-ignored`` is opted in, since vllm-mlx's
    ``_make_cache`` and ``make_prompt_cache`` aliases are its targets.
    """
    extra = {"KVPATCH_ENABLE": "max-kv-size-ignored", **(env or {})}
    if order == "server-first":
        extra["KVPATCH"] = "off"
    proc = subprocess.run(
        [sys.executable, str(HERE / "scenarios.py"), args[0], order, *args[1:]],
        cwd=HERE,
        env=child_env(extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"scenario {args} ({order}) failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])
