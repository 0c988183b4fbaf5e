"""hybrid-quant-dtype beyond the reproduction: a tiny bf16 pixtral language model decoding with
HybridQuantKVCache stays bf16 end to end (float32 logits without the patch), and its logits stay within
bf16 rounding of the unpatched (float32-promoted) run; every scheme pairing returns the fed dtype.
"""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_vlm.hybrid_quant_dtype import PATCH, policy
from kvpatch.testing import difference, tiny_pixtral_language_model, without

TOKENS = [5, 9, 2, 33, 17, 21]
STEPS = [3, 40, 11]


pytestmark = pytest.mark.requires_patch(PATCH.id)


@pytest.fixture(scope="module", autouse=True)
def _in_range():
    pytest.importorskip("mlx_vlm.turboquant").HybridQuantKVCache  # noqa: B018


def _decode(model, schemes):
    import mlx.core as mx
    from mlx_vlm.turboquant import HybridQuantKVCache

    cache = [HybridQuantKVCache(policy(*schemes)) for _ in model.layers]
    out = [model(mx.array([TOKENS]), cache=cache)]
    out += [model(mx.array([[t]]), cache=cache) for t in STEPS]
    return [getattr(o, "logits", o)[0, -1] for o in out]


@pytest.mark.parametrize(
    "schemes", [("turboquant", "uniform"), ("uniform", "turboquant"), ("turboquant", "turboquant")]
)
def test_bf16_model_stays_bf16(schemes):
    import mlx.core as mx

    model = tiny_pixtral_language_model(head_dim=64, dtype=mx.bfloat16)
    patched = _decode(model, schemes)
    assert {str(x.dtype) for x in patched} == {"mlx.core.bfloat16"}, [x.dtype for x in patched]
    with without(PATCH.id):
        upstream = _decode(model, schemes)
    for step, (a, b) in enumerate(zip(patched, upstream, strict=True)):
        found = difference(a, b, mx.bfloat16, where=f"step {step}: logits against the float32-promoted run")
        assert found.within, found
