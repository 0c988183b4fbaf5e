"""Tests that need a real mlx-lm / mlx-vlm release. They run inside matrix buckets
(tests/test_matrix.py runs this folder once per bucket) and in any environment where upstream is
installed; elsewhere they are skipped."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tiers import may_lack_kernel

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("mlx") is not None:
        return
    skip = pytest.mark.skip(reason="mlx is not installed here; these tests run inside matrix buckets")
    for item in items:
        # (this hook sees the whole session's items: mark only this folder's)
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test named in ``tiers.MAY_LACK_KERNEL`` that is stopped by a kernel the mlx backend lacks (e.g. a
    ``quantized_matmul`` shape CUDA has no implementation for, in upstream's own quantized path that the test
    compares against) is skipped with the backend's own message. Any other test fails: a patch must never route
    into a kernel the backend lacks."""
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is None or not report.failed or not call.excinfo.errisinstance((RuntimeError, ValueError)):
        return
    from kvpatch.testing import backend_gap

    gap = backend_gap(str(call.excinfo.value))
    if gap and may_lack_kernel(item.nodeid):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: the mlx backend lacks a kernel: {gap}")
