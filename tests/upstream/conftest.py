"""Tests that need a real mlx-lm / mlx-vlm release. They run inside matrix buckets
(tests/test_matrix.py runs this folder once per bucket) and in any environment where upstream is
installed; elsewhere they are skipped."""

from __future__ import annotations

import importlib.util

import pytest


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("mlx") is None:
        skip = pytest.mark.skip(reason="mlx is not installed here; these tests run inside matrix buckets")
        for item in items:
            item.add_marker(skip)
