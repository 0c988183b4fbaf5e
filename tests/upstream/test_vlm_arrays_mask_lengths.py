"""vlm-arrays-mask-lengths beyond its reproduction, on a tiny random mlx-vlm Qwen3.5 language model (one
Gated DeltaNet layer, one attention layer): a right-padded prefill on mlx-vlm's own ArraysCache that also
has left padding leaves the padded row's recurrent state equal to the row prefilled alone.

(With every row's left padding 0, Qwen3.5's own ``_create_qwen3_5_ssm_mask`` returns no mask at all, also
when ``lengths`` is set: a separate, model-level bug this patch does not touch, so the case here gives one
row real left padding.)
"""

from __future__ import annotations

import pytest
from support import arrays_state_difference

import kvpatch
from kvpatch.patches import _arrays
from kvpatch.patches.mlx_vlm.arrays_mask_lengths import PATCH
from kvpatch.testing import without

# Applies by version, or where the reproduction decides (archive, editable, git installs: the GPU host's wheel files)
# by this environment's verdict; on the H100 a worker of the whole suite once ran this test with the patch not
# installed (its error equalled the unpatched 0.339), a rerun with the verdicts in place passed
pytestmark = pytest.mark.requires_patch(PATCH.id, applies=True)


@pytest.fixture(scope="module", autouse=True)
def _in_range():
    if _arrays.vlm_own_arrays_cache() is None:
        pytest.skip("this mlx-vlm has no ArraysCache of its own")


def _patched() -> bool:
    return bool(kvpatch.get_engine().status[PATCH.id].installed)


def _tiny_qwen3_5():
    import mlx.core as mx
    from mlx_vlm.models.qwen3_5.config import ModelConfig, TextConfig, VisionConfig
    from mlx_vlm.models.qwen3_5.language import LanguageModel

    mx.random.seed(0)
    text = TextConfig(
        model_type="qwen3_5",
        hidden_size=64,
        intermediate_size=128,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_hidden_layers=2,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        vocab_size=97,
        num_key_value_heads=2,
        max_position_embeddings=512,
        head_dim=16,
        full_attention_interval=2,
        rope_parameters={
            "type": "default",
            "mrope_section": [1, 1, 0],
            "rope_theta": 10000,
            "partial_rotary_factor": 0.25,
        },
    )
    config = ModelConfig(text_config=text, vision_config=VisionConfig(), model_type="qwen3_5")
    model = LanguageModel(text, config)
    mx.eval(model.parameters())
    return model


def _state_difference(model):
    """Row 1 of a batch ([pad, 10, 11] + 5 pads: left padding 1, length 3) against [10, 11] alone."""
    from mlx_vlm.models.cache import ArraysCache

    batch = [[1, 2, 3, 4, 5, 6, 7, 8], [0, 10, 11, 0, 0, 0, 0, 0]]
    return arrays_state_difference(model, ArraysCache, batch, [0, 1], [8, 3], 1, [10, 11])


def test_recurrent_state_ignores_right_padding():
    model = _tiny_qwen3_5()
    found = _state_difference(model)
    assert found.within, found
    if _patched():
        with without(PATCH.id):
            found = _state_difference(model)
            assert not found.within, found  # measured 0.019 (0.6.4, 0.6.15), 0.339 (0.7.10)
