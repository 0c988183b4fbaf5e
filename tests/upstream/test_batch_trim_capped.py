"""batch-trim-capped (C4) beyond its reproduction: ``_trim_cases`` on mlx-lm's ``BatchKVCache`` (the catalogue case,
the ordinary speculative rollback, no host synchronisation)."""

from __future__ import annotations

import pytest
from _trim_cases import no_host_sync, ordinary_rollback_unchanged, trim_past_a_short_row

from kvpatch.patches.mlx_lm.batch_trim_capped import PATCH
from kvpatch.testing import tiny_llama

pytestmark = pytest.mark.requires_patch(PATCH.id)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def caches():
    from mlx_lm.models import cache

    return cache


def test_trim_past_a_short_row(model, caches):
    trim_past_a_short_row(model, caches)


def test_ordinary_rollback_unchanged(model, caches):
    ordinary_rollback_unchanged(model, caches)


@pytest.mark.requires_patch(PATCH.id, applies=True)
def test_no_host_sync(caches):
    no_host_sync(caches)
