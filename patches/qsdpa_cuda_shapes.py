"""qsdpa-cuda-shapes: mlx-lm's quantized KV cache does not run on MLX's CUDA backend at all.

Broken: on an NVIDIA GPU (mlx 0.32.4 CUDA 13, H100) every ``generate_step(..., kv_bits=4 or 8)`` (and so
``mlx_lm.generate --kv-bits``, and servers with quantized caches) raises at the first quantized attention
step, in prefill and in decode: ``[quantized_matmul] No implementation for problem shape: 1x39x128x8,
transpose: true, activation: bfloat16, bits: 8, group size: 64, mode: "affine"`` (M x N x K x batch).

What CUDA lacks, measured on the H100 with ``scripts/probe_quantized_sdpa.py`` (both products of
``mlx_lm.models.base.quantized_scaled_dot_product_attention``, bfloat16 and float32, 4 and 8 bits, group size
64, head dims 64 and 128, 8 geometries): mlx's CUDA ``quantized_matmul`` has a kernel only for quantized
operands whose data is contiguous, and none for the grouped-query layout this function builds.

* keys/values as the quantized caches hand them out (``buffer[..., :offset, :]`` of a step-sized buffer, a
  strided view whenever batch x KV heads > 1): every geometry fails, scores and output product alike, all
  dtypes/bits/head dims (e.g. one row, 8 MHA heads, decode: ``1x39x128x8``); batch x KV heads == 1 works;
* grouped-query attention (queries reshaped to ``(B, n_kv, n_rep, L, D)``, keys expanded to
  ``(B, n_kv, 1, S, D)``): fails even on fresh contiguous keys when head dim == group size (64/64: ``3x7x64x8``,
  ``1x39x64x8``...); head dim 128 works when contiguous;
* plain multi-head attention on contiguous keys works in every case probed (M 1..39, batch 1..32).

A direct ``mx.quantized_matmul`` of 4-axis queries against freshly quantized 4-axis keys works, which is why
the issue first looked like a kernel gap in some sizes only. The CPU and Metal backends compute every case.

Not reported upstream (mlx: CUDA ``QuantizedMatmul::eval_gpu`` checks ``is_last_2_dims_row_contiguous`` on
the quantized operands and has no broadcast-batch path for them; mlx-lm: the function assumes any layout
works). Checked on mlx 0.32.4 with mlx-lm 0.32.2; mlx-lm has had this function, unchanged in these respects,
since 0.19.3.

Fix (CUDA only, decided once when the patch is built: the builder returns the original on CPU and Metal): a
delta in front of the original that routes to the layouts CUDA computes. Keys and values are made contiguous
(``mx.contiguous``, which copies only a strided view: one copy of the cached prefix per layer per step, the size
the product reads anyway), and grouped-query attention is folded into multi-head attention over the KV heads:
queries ``(B, n_q, L, D)`` become ``(B, n_kv, n_rep * L, D)`` (query head ``h`` stays with KV head
``h // n_rep``, upstream's own grouping), a ``"causal"`` mask becomes the boolean mask upstream builds from it,
an array mask ``(..., 1 | n_q, L, S)`` is laid out the same way as the queries, the original runs its 4-axis
path, and the output is reshaped back to ``(B, n_q, L, D)``. Same arithmetic, no host synchronisation.
Composition: order 90, outermost: ``qsdpa-gqa-batch-mask`` (order 20) and ``mask-fill`` (order 10) then see
plain multi-head attention with an explicit mask, which they leave alone or convert as usual. (On CUDA the fold
also sidesteps A3's mask misalignment, so there ``KVPATCH_DISABLE=qsdpa-gqa-batch-mask`` alone no longer shows
A3 on mlx-lm < 0.32; without this patch too, the kernel error comes first.)

Checked on the H100 (mlx 0.32.4, mlx-lm 0.32.2, mlx-vlm 0.7.10): ``status --verify`` "bug present, fixed by
patch" for both twins; ``generate_step(kv_bits=8 or 4, kv_group_size=64)`` on a bf16 llama with head dim 128 and
8/2 heads raises without the patch (``1x39x128x8``) and generates with it. Not covered by routing: where mlx
picks its Hopper kernel (``qmm_sm90_*``, e.g. head dim == group size == 64 and batch x M >= 2) it compiles it at
run time, and on that host the compile failed (``crt/mma.h`` missing from the CUDA headers: the package
``nvidia-cuda-crt``, which mlx-cuda-13 does not require); that is the host's toolkit, not a layout.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _cuda

from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="qsdpa-cuda-shapes",
    summary="quantized SDPA hands CUDA's quantized_matmul strided cache views and a 5-axis GQA layout (no kernel)",
    distribution="mlx-lm",
    affected=">=0.19.3,<=0.32.2",
    checked_through="0.32.2",
    reference="not reported upstream (mlx CUDA backend, mlx 0.32.4)",
    hot_path=True,
    enabler=True,
    order=90,
    expiry=Expiry(
        "retire when mlx's CUDA quantized_matmul takes strided and broadcast quantized operands, or mlx-lm's "
        "quantized SDPA stops producing them",
        review_by=_dt.date(2027, 3, 1),
    ),
)


@PATCH.replace("mlx_lm.models.base", "quantized_scaled_dot_product_attention")
def _build(original: Any) -> Any:
    import mlx.core as mx

    if not _cuda.on_cuda(mx):
        return original  # CPU and Metal compute every layout: nothing to route
    return _cuda.routing(original, _cuda.upstream_align(original))


@PATCH.reproduce
def reproduce() -> Finding:
    """mlx-lm's quantized attention on cache-like (strided) quantized keys/values, GQA and MHA, on CUDA."""
    from mlx_lm.models import base

    return _cuda.check(base.quantized_scaled_dot_product_attention, "mlx_lm.models.base")
