"""vlm-qsdpa-cuda-shapes: mlx-vlm's own quantized attention does not run on MLX's CUDA backend (twin of
qsdpa-cuda-shapes).

Broken: from 0.6.4 mlx-vlm has its own copy of the quantized SDPA (``mlx_vlm.models.base``; in 0.6.5 a second
copy in ``mlx_vlm.models.text_models.base``), called by every mlx-vlm model whose cache is a
``QuantizedKVCache`` / ``BatchQuantizedKVCache`` (``--kv-bits``, continuous batching with quantized caches). It
hands CUDA's ``quantized_matmul`` the same operands as mlx-lm's: strided views of the cache buffers and the
5-axis grouped-query layout, and where a kernel exists it computes wrong scores. On an H100 (mlx 0.32.4,
mlx-vlm 0.7.10) such calls raise, e.g.
``[quantized_matmul] No implementation for problem shape: 7x7x64x12, transpose: true, activation: bfloat16,
bits: 4`` (a pixtral language model, batch 3, 4 query / 2 KV heads) or ``3x6x64x8`` (float32, GQA, fresh
contiguous keys with head dim == group size), or return garbage. Measured shapes, results and the reason:
see ``kvpatch/patches/mlx_lm/qsdpa_cuda_shapes.py``. mlx-vlm 0.6.3 and older use mlx-lm's function
(qsdpa-cuda-shapes covers them).
TurboQuant caches do not go through this function (they dequantize or use their own kernels) and run on CUDA.

Fix: the same as qsdpa-cuda-shapes (``kvpatch/patches/_cuda.py``): dequantized keys/values through
``mx.fast.scaled_dot_product_attention``, CUDA only, decided when the patch is built. Masks are first put through
the module's own ``align_attention_mask_to_scores`` where it has one (it reads a 3-axis mask as ``(B, L, S)``).
Composition: order 90, outermost, and it does not call inward (``vlm-qsdpa-batch-mask`` fixes arithmetic this
path does not use).
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _cuda, _reproduce
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="vlm-qsdpa-cuda-shapes",
    summary="mlx-vlm quantized SDPA hands CUDA's quantized_matmul layouts it has no kernel for",
    distribution="mlx-vlm",
    affected=">=0.6.4,<=0.7.10",
    checked_through="0.7.10",
    reference="not reported upstream (mlx CUDA backend, mlx 0.32.4; mlx-lm twin: qsdpa-cuda-shapes)",
    catalogue="CUDA (docs/cuda.md)",
    hot_path=True,
    enabler=True,
    on_device=True,  # a bug of the CUDA backend's kernels: measured where the user computes
    order=90,
    expiry=Expiry(
        "retire when mlx's CUDA quantized_matmul computes attention's scores product (transpose=True) right for "
        "strided, broadcast and small-group-count quantized keys, or mlx-vlm's quantized SDPA stops using it",
        review_by=_dt.date(2027, 3, 1),
    ),
)


PATCH.replace("mlx_vlm.models.text_models.base", "quantized_scaled_dot_product_attention", optional=True)(_cuda.routed)
PATCH.replace("mlx_vlm.models.base", "quantized_scaled_dot_product_attention")(_cuda.routed)


@PATCH.reproduce
def reproduce() -> Finding:
    """mlx-vlm's quantized attention (each copy) on cache-like quantized keys/values, GQA and MHA, on CUDA."""
    findings = [
        _cuda.check(module.quantized_scaled_dot_product_attention, name)
        for name, module in _reproduce.vlm_quantized_attentions()
    ]
    if not findings:
        return Finding(False, "this mlx-vlm has no quantized attention of its own: nothing to fix")
    measured = [f for f in findings if f.error is not None and f.rounding]
    biggest = max(measured, key=lambda f: f.error / f.rounding, default=None)  # type: ignore[operator]
    sizes: dict[str, Any] = {"error": biggest.error, "rounding": biggest.rounding} if biggest else {}
    for bug in ("skipped", "inconclusive", "present"):
        hit = [f for f in findings if f.bug == bug]
        if hit:
            return Finding(
                bug == "present",
                "; ".join(f.detail for f in hit if f.detail),
                skipped=hit[0].skipped,
                inconclusive="; ".join(f.inconclusive for f in hit if f.inconclusive) or None,
                **sizes,
            )
    return Finding(False, "; ".join(f.detail for f in findings), **sizes)
