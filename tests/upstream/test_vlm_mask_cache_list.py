"""vlm-mask-cache-list beyond its reproduction: a tiny idefics2 language model (TextConfig, random weights) over
left-padded batches of several shapes gives each prompt the logits it has alone, prefill and decode; a single cache,
no cache and an empty list get exactly what upstream gives them."""

from __future__ import annotations

import pytest
from _batched_cases import LENGTHS, rows_agree

from kvpatch.patches.mlx_vlm.mask_cache_list import PATCH, tiny_model
from kvpatch.testing import require_affected, with_and_without

# skips where the installed upstream is not in the patch's range (tests/upstream/conftest.py)
pytestmark = pytest.mark.requires_patch(PATCH.id)


@pytest.fixture(scope="module", autouse=True)
def _in_range():
    require_affected(PATCH)


# Without the patch (KVPATCH_DISABLE=vlm-mask-cache-list) the padded cases differ (prompts of one length do not):
#   KVPATCH_DISABLE=vlm-mask-cache-list .venv/bin/python scripts/in_bucket.py vlm-0.7.8 -- python -m pytest tests/upstream/test_vlm_mask_cache_list.py -q   # fails
#   .venv/bin/python scripts/in_bucket.py vlm-0.7.8 -- python -m pytest tests/upstream/test_vlm_mask_cache_list.py -q   # passes
@pytest.mark.parametrize("lengths", LENGTHS)
def test_batched_prompts_get_the_logits_they_have_alone(lengths):
    from mlx_vlm.models import cache

    rows_agree(tiny_model(), cache, lengths)


def test_a_single_cache_no_cache_and_an_empty_list_are_upstreams():
    import mlx.core as mx
    from mlx_vlm.models import base
    from mlx_vlm.models.cache import BatchKVCache

    h = mx.zeros((2, 3, 8))

    def run():
        cache = BatchKVCache([1, 0])
        masks = [base.create_attention_mask(h, cache, return_array=True), base.create_attention_mask(h, None)]
        masks.append(base.create_attention_mask(h, []))
        return [m.tolist() if isinstance(m, mx.array) else m for m in masks]

    patched, unpatched = with_and_without(PATCH.id, run)
    assert patched == unpatched
