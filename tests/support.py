"""Helpers shared by the test modules (a plain module: ``from conftest import`` is ambiguous, since
tests/upstream has a conftest of its own)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: Matrix results for the closing summary (tests/conftest.py): bucket name -> (exit code, its pytest summary line).
MATRIX_RESULTS = pytest.StashKey[dict]()
#: How many buckets were selected (KVPATCH_MATRIX), for the same summary.
MATRIX_SELECTED = pytest.StashKey[int]()


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("KVPATCH") or k in ("KVPATCH_CACHE", "KVPATCH_BUCKET")
    }
    env.update(extra or {})
    return env
