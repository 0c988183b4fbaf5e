"""churn-metadata-detach-vlm beyond its reproduction: mlx-vlm's own BatchKVCache, ArraysCache and a CacheList of both
keep no pending metadata graph over 500 join/decode/leave cycles, with values unchanged; where mlx-vlm re-exports
mlx-lm's classes (< 0.6.4) this unit leaves them to churn-metadata-detach."""

from __future__ import annotations

import _churn_cases
import pytest

from kvpatch.patches import _churn
from kvpatch.patches.mlx_vlm.churn_metadata_detach import CLASSES, PATCH
from kvpatch.testing import require_affected, without


@pytest.fixture(scope="module", autouse=True)
def _in_range():
    require_affected(PATCH)


@pytest.mark.parametrize("kind", [*CLASSES, "CacheList"])
def test_churn_keeps_no_pending_metadata(kind):
    import mlx_vlm.models.cache as cache

    _churn_cases.bounded(cache, kind)


@pytest.mark.parametrize("kind", [*CLASSES, "CacheList"])
def test_churn_values_are_upstreams(kind):
    import mlx_vlm.models.cache as cache

    _churn_cases.same_values(cache, kind, PATCH.id)


def test_own_classes_wrapped_mlx_lm_classes_left_alone():
    """Each target of this unit is wrapped on mlx-vlm's own class; mlx-lm's classes are not wrapped a second time."""
    import mlx_lm.models.cache as lm_cache
    import mlx_vlm.models.cache as vlm_cache

    for name in CLASSES:
        assert _churn.vlm_own(name) is getattr(vlm_cache, name), name
        for method in ("extend", "filter"):
            patched = getattr(getattr(vlm_cache, name), method)
            with without(PATCH.id):
                assert getattr(getattr(vlm_cache, name), method) is not patched, (name, method)
                lm_method = getattr(getattr(lm_cache, name), method)
            assert getattr(getattr(lm_cache, name), method) is lm_method, (name, method)
