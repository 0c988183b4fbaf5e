"""Tests that need a real mlx-lm / mlx-vlm release. They run inside matrix buckets
(tests/test_matrix.py runs this folder once per bucket) and in any environment where upstream is
installed; elsewhere they are skipped.

A per-patch test says which patch it is about with one marker, the one way such a test skips where its patch is
not in play (for a whole file: ``pytestmark = pytest.mark.requires_patch(PATCH.id)``):

``requires_patch(id)``               skip unless the installed upstream is in the patch's affected range
                                     (``kvpatch.testing.require_affected``); the patch's targets are imported
``requires_patch(id, needed=True)``  also skip where the patch is not needed (fixed there)
``requires_patch(id, applies=True)`` skip unless the patch applies here (``kvpatch.testing.require_applies``); a
                                     patch switched off with ``KVPATCH_DISABLE`` still runs the test, which then fails
"""

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


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires_patch(id, applies=False, needed=False): skip unless the patch is in play here"
    )


def pytest_runtest_setup(item):
    mark = item.get_closest_marker("requires_patch")
    if mark is not None:
        requires_patch(*mark.args, **mark.kwargs)


def requires_patch(patch_id: str, *, applies: bool = False, needed: bool = False) -> None:
    """Skip the running test unless ``patch_id`` is in play in this upstream (see the module docstring)."""
    from kvpatch import registry
    from kvpatch.gate import Action
    from kvpatch.testing import require_affected, require_applies

    patch = next(p for p in registry.load().patches if p.id == patch_id)
    decision = require_applies(patch) if applies else require_affected(patch)
    if needed and decision.action is Action.NOT_NEEDED:
        pytest.skip(f"{patch.id}: {decision.reason}")


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
