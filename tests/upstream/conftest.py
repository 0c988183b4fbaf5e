"""Tests that need a real mlx-lm / mlx-vlm release. They run inside matrix buckets
(tests/test_matrix.py runs this folder once per bucket) and in any environment where upstream is
installed; elsewhere they are skipped."""

from __future__ import annotations

import importlib.util
import os

# Opt-in patches (behaviour changes such as max-kv-size-ignored) are tested like every other patch here; that
# they stay off by default is tested in child processes, which do not inherit this (tests/support.child_env).
os.environ.setdefault("KVPATCH_ENABLE", "*")
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("mlx") is not None:
        return
    skip = pytest.mark.skip(reason="mlx is not installed here; these tests run inside matrix buckets")
    for item in items:
        # (this hook sees the whole session's items: mark only this folder's)
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)
