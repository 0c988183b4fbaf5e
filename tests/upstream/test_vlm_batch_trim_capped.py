"""vlm-batch-trim-capped (C4, mlx-vlm's copy) beyond its reproduction: ``_trim_cases`` on mlx-vlm's own
``BatchKVCache`` (from 0.6.4) under a tiny random-weight llama, as batch-trim-capped's tests drive mlx-lm's.

Without the patch the catalogue case fails (offset [-1, 3]):
  KVPATCH_DISABLE=vlm-batch-trim-capped .venv/bin/python scripts/in_bucket.py vlm-0.7.10 -- python -m pytest tests/upstream/test_vlm_batch_trim_capped.py -q   # fails
  .venv/bin/python scripts/in_bucket.py vlm-0.7.10 -- python -m pytest tests/upstream/test_vlm_batch_trim_capped.py -q   # passes
"""

from __future__ import annotations

import pytest
from _trim_cases import no_host_sync, ordinary_rollback_unchanged, trim_past_a_short_row

from kvpatch.patches.mlx_vlm.batch_trim_capped import PATCH
from kvpatch.testing import tiny_llama

pytestmark = pytest.mark.requires_patch(PATCH.id)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def caches():
    from mlx_vlm.models import cache

    return cache


def test_trim_past_a_short_row(model, caches):
    trim_past_a_short_row(model, caches)


def test_ordinary_rollback_unchanged(model, caches):
    ordinary_rollback_unchanged(model, caches)


@pytest.mark.requires_patch(PATCH.id, applies=True)
def test_no_host_sync(caches):
    no_host_sync(caches)
