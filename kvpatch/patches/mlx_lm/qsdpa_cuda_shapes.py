"""qsdpa-cuda-shapes: mlx-lm's quantized KV cache does not run, or computes garbage, on MLX's CUDA backend.

Broken: on an NVIDIA GPU (mlx 0.32.4 CUDA 13, H100) every ``generate_step(..., kv_bits=4 or 8)`` (and so
``mlx_lm.generate --kv-bits``, and servers with quantized caches) fails at the first quantized attention step,
in prefill and in decode. mlx-lm's ``quantized_scaled_dot_product_attention`` makes two
``mx.quantized_matmul`` calls, scores = queries x keys^T (``transpose=True``) and out = weights x values, and
CUDA's kernels do not compute the first one for the operands attention has:

* keys as the quantized caches hand them out (``buffer[..., :offset, :]``, a strided view whenever batch x KV
  heads > 1) and the 5-axis grouped-query layout raise ``[quantized_matmul] No implementation for problem
  shape: 1x39x128x8, transpose: true, activation: bfloat16, bits: 8, group size: 64`` (M x N x K x batch;
  ``scripts/probe_quantized_sdpa.py``);
* where a kernel exists, the result is wrong: measured on the H100 with ``scripts/probe_quantized_sdpa.py
  --numbers`` (head dim 64, group size 64, bits 4 and 8, float32 and bfloat16, contiguous keys), 48 of 72
  scores products per dtype were off by 16 to 1e38 or NaN: every case with more than one query row, or more
  than one batch x head, at 12, 64 or 256 keys; 39 keys and the single-row single-head case were exact.
  bfloat16 also printed ``Failed to initialize the TMA descriptor`` for descriptors whose scale rows were 2
  bytes apart (a KV cache has ``head_dim / group_size`` scales per row; likely below the 16-byte alignment
  Hopper's TMA needs, not confirmed). The weights x values
  product was right in all 144 cases. That host had ``nvidia-cuda-crt`` installed; without it the same
  kernels fail to compile (``crt/mma.h``), so the call raises instead.

CPU and Metal compute every case. Not reported upstream yet (mlx: CUDA ``QuantizedMatmul``; mlx-lm: the function
assumes the backend computes any layout). mlx-lm has had this function, unchanged in these respects, since
0.19.3.

Fix (CUDA only, decided once when the patch is built: the builder returns the original on CPU and Metal): the
replacement does not call the transposed ``quantized_matmul`` at all. It dequantizes the keys and values
(``mx.dequantize``, the data the products read) and runs ``mx.fast.scaled_dot_product_attention`` (grouped
query heads, boolean, additive and ``"causal"`` masks as upstream means them; ``kvpatch/patches/_cuda.py``). Same
attention, no host synchronisation; the cost is one layer's keys and values in floating point while that layer
runs. Composition: order 90, outermost, and it does not call inward: ``qsdpa-gqa-batch-mask`` and ``mask-fill``
fix upstream's arithmetic, which this path does not use.
"""

from __future__ import annotations

import datetime as _dt

from kvpatch.patches import _cuda
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="qsdpa-cuda-shapes",
    summary="quantized SDPA hands CUDA's quantized_matmul strided cache views and a 5-axis GQA layout (no kernel)",
    distribution="mlx-lm",
    affected=">=0.19.3,<=0.32.2",
    checked_through="0.32.2",
    reference="not reported upstream (mlx CUDA backend, mlx 0.32.4)",
    catalogue="CUDA (docs/cuda.md)",
    hot_path=True,
    enabler=True,
    on_device=True,  # a bug of the CUDA backend's kernels: measured where the user computes
    order=90,
    expiry=Expiry(
        "retire when mlx's CUDA quantized_matmul computes attention's scores product (transpose=True) right for "
        "strided, broadcast and small-group-count quantized keys, or mlx-lm's quantized SDPA stops using it",
        review_by=_dt.date(2027, 3, 1),
    ),
)


PATCH.replace("mlx_lm.models.base", "quantized_scaled_dot_product_attention")(_cuda.routed)


@PATCH.reproduce
def reproduce() -> Finding:
    """mlx-lm's quantized attention on cache-like (strided) quantized keys/values, GQA and MHA, on CUDA."""
    from mlx_lm.models import base

    return _cuda.check(base.quantized_scaled_dot_product_attention, "mlx_lm.models.base")
