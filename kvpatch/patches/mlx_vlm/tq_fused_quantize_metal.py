"""tq-fused-quantize-metal (catalogue M2, Metal only): single-token TurboQuant quantize stores keys in the wrong basis.

Broken: ``TurboQuantKVCache.update_and_fetch`` first tries ``_try_fused_kv_quantize``, which on Metal
quantizes a one-token key/value pair in one dispatch of ``_fused_kv_quantize_kernel``. That kernel rotates
with the codec's dense ``rotation`` matrix, but from mlx-vlm 0.4.4 (90732bde, #909) the MSE codec uses a
randomized Hadamard transform instead whenever the head dim is a power of two (``use_rht``, the common
case: 64/128/256), and everything else (prefill via ``codec.quantize``, ``dequantize``, the decode
kernels) reads the cache in the Hadamard basis. So every decoded token's key and value is stored in the
wrong basis: upstream measured rel. error 0.23–0.40 for "prefill 16 + decode 1" against "prefill 17"
(D=64/128/256, 4 bits), the catalogue ~140% per token and garbage decode. Fixed upstream by declining the
fused path for RHT codecs (Blaizzy/mlx-vlm#973, 048642ff, released in 0.6.0).

Metal only: ``_fused_kv_quantize_kernel`` returns ``None`` without a Metal device, and the cache then uses
``codec.quantize``, which is correct. Not measured here (Linux CPU); what was measured, on the installed
wheels: 0.4.4 and 0.5.0 consult the fused kernel factory for one-token updates with RHT codecs (head dim
64, 4 bits), 0.6.0 does not; 0.4.3 has neither RHT nor this method. Range 0.4.4–0.5.0, as catalogued.

Fix: a delta in front of the original: when either codec uses the Hadamard rotation, answer
``(None, None)`` (the original's own "no fused path" answer), so ``update_and_fetch`` falls through to
``key_codec.quantize`` / ``value_codec.quantize``, upstream's non-fused path, which handles RHT (its L=1
branch applies ``mx.hadamard_transform`` before its own packing kernel). Dense-rotation codecs (head dims
that are not a power of two) keep the fused kernel, which is correct for them. Cost per call: two
attribute reads; no host synchronisation.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _reproduce
from kvpatch.patches._numbers import difference, judge, worst
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="tq-fused-quantize-metal",
    summary="TurboQuant one-token fused K/V quantize rotates densely while the codec uses Hadamard (Metal)",
    distribution="mlx-vlm",
    affected=">=0.4.4,<0.6.0",
    fixed_in="0.6.0",
    fixed_commit="048642ff",
    introduced_commit="90732bde",
    reference="Blaizzy/mlx-vlm#973",
    catalogue="M2",
    hot_path=True,
    metal_only=True,
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-vlm < 0.6.0 (and git pins before 048642ff)",
        review_by=_dt.date(2027, 6, 1),
    ),
)


@PATCH.replace("mlx_vlm.turboquant", "TurboQuantKVCache._try_fused_kv_quantize")
def _build(original: Any) -> Any:
    def _try_fused_kv_quantize(self: Any, keys: Any, values: Any) -> Any:
        if getattr(self.key_codec, "use_rht", False) or getattr(self.value_codec, "use_rht", False):
            return None, None
        return original(self, keys, values)

    return _try_fused_kv_quantize


def measure() -> Finding:
    """Prefill 16 tokens then decode 1 against prefilling all 17 at once (head dim 64, 4 bits): the decoded
    token's dequantized key and value must be the same. Runs on any backend (on CPU both take the
    non-fused path); the reproduction only calls it where the fused Metal kernel can run."""
    import mlx.core as mx
    from mlx_vlm.turboquant import TurboQuantKVCache

    mx.random.seed(0)
    keys, values = mx.random.normal((1, 2, 17, 64)), mx.random.normal((1, 2, 17, 64))
    stepwise = TurboQuantKVCache(bits=4)
    stepwise.update_and_fetch(keys[:, :, :16], values[:, :, :16])
    k_state, v_state = stepwise.update_and_fetch(keys[:, :, 16:], values[:, :, 16:])
    k_step, v_step = stepwise.dequantize(k_state, v_state)
    at_once = TurboQuantKVCache(bits=4)
    k_state, v_state = at_once.update_and_fetch(keys, values)
    k_ref, v_ref = at_once.dequantize(k_state, v_state)
    found = [
        difference(got[:, :, 16:], ref[:, :, 16:], mx.float32, where=f"the decoded token's {name}")
        for name, got, ref in (("key", k_step, k_ref), ("value", v_step, v_ref))
    ]
    return judge(
        worst(found),
        "the decoded token's key/value differ from the one-shot prefill",
        "the decoded token equals the one-shot prefill",
    )


@PATCH.reproduce
def reproduce() -> Finding:
    return _reproduce.on_turboquant_metal(measure, "the fused K/V quantize kernel exists", "non-fused path")
