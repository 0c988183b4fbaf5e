"""vlm-gemma2-batch-mask beyond its reproduction: a tiny mlx-vlm gemma2 LanguageModel (ModelConfig, random weights)
over left-padded batches of several shapes gives each prompt the logits it has alone, prefill and decode; a single
prompt's forward pass, and a layer without grouped queries, get exactly what upstream gives them."""

from __future__ import annotations

import pytest
from _batched_cases import LENGTHS, gemma2_untouched_paths, rows_agree

from kvpatch.patches.mlx_vlm.gemma2_batch_mask import PATCH, tiny_model
from kvpatch.testing import require_affected

# skips where the installed upstream is not in the patch's range (tests/upstream/conftest.py)
pytestmark = pytest.mark.requires_patch(PATCH.id)


@pytest.fixture(scope="module", autouse=True)
def _in_range():
    require_affected(PATCH)


# Without the patch (KVPATCH_DISABLE=vlm-gemma2-batch-mask) the padded cases raise ValueError: [broadcast_shapes]
# (prompts of one length get no per-row mask):
#   KVPATCH_DISABLE=vlm-gemma2-batch-mask .venv/bin/python scripts/in_bucket.py vlm-0.7.10 -- python -m pytest tests/upstream/test_vlm_gemma2_batch_mask.py -q   # fails
#   .venv/bin/python scripts/in_bucket.py vlm-0.7.10 -- python -m pytest tests/upstream/test_vlm_gemma2_batch_mask.py -q   # passes
@pytest.mark.parametrize("lengths", LENGTHS)
def test_batched_prompts_get_the_logits_they_have_alone(lengths):
    from mlx_vlm.models import cache

    rows_agree(tiny_model(), cache, lengths)


def test_a_single_prompt_and_an_ungrouped_layer_are_upstreams():
    from mlx_vlm.models import cache
    from mlx_vlm.models.gemma2.config import ModelConfig
    from mlx_vlm.models.gemma2.language import Attention

    gemma2_untouched_paths(PATCH.id, tiny_model(), cache, Attention, ModelConfig, lambda out: out.logits)
