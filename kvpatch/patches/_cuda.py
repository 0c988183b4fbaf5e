"""Shared by qsdpa-cuda-shapes (mlx-lm) and vlm-qsdpa-cuda-shapes (mlx-vlm): quantized attention on MLX's CUDA
backend, computed from dequantized keys and values (its transposed ``quantized_matmul`` is wrong or missing there).

Not a patch unit (units live in the distribution folders). Imports mlx lazily.
"""

from __future__ import annotations

from typing import Any

from kvpatch.patches._numbers import difference, judge, worst
from kvpatch.record import Finding, symptom

#: How mlx's CUDA backend says it has no kernel for a ``quantized_matmul`` (mlx 0.32.4).
NO_KERNEL = "No implementation for problem shape"


def cuda_available(mx: Any) -> bool:
    """True when this mlx has its CUDA backend and a GPU to run it (``mx.cuda`` exists from mlx 0.28)."""
    cuda = getattr(mx, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_available())
    except Exception:  # an mlx build whose cuda module cannot answer: not CUDA as far as we know
        return False


def on_cuda(mx: Any) -> bool:
    """True when mlx computes on an NVIDIA GPU by default."""
    return cuda_available(mx) and mx.default_device().type == mx.DeviceType.gpu


def backend(mx: Any) -> str:
    """The backend mlx computes on by default, in words (for skip reasons)."""
    if on_cuda(mx):
        return "CUDA"
    metal = getattr(mx, "metal", None)
    if metal is not None and metal.is_available() and mx.default_device().type == mx.DeviceType.gpu:
        return "Metal"
    return "CPU"


def dequantized_attention(align: Any = None) -> Any:
    """Quantized attention with upstream's signature that CUDA computes correctly (replaces upstream's function).

    mlx 0.32.4's CUDA ``quantized_matmul`` with ``transpose=True`` (the scores product, queries x keys^T) is
    wrong or raises for the operands attention hands it (measured on an H100 with ``scripts/probe_quantized_sdpa.py
    --numbers``: head dim 64, group size 64, bits 4 and 8, float32 and bfloat16): with more than one query row or
    more than one batch x head, and a key count of 12, 64 or 256, the result is garbage (max error 16 to 1e38,
    or NaN; bfloat16 also prints "Failed to initialize the TMA descriptor" for descriptors whose scale rows are 2
    bytes apart, likely below the 16-byte alignment Hopper's TMA needs); where no kernel
    was built it raises "No implementation for problem shape" instead. A key count of 39, and one query row of one
    head, were exact. The ``transpose=False`` product was right in all 144 cases probed.

    So on CUDA upstream's function is not called: keys and values are dequantized (``mx.dequantize``, the data the
    quantized products read) and ``mx.fast.scaled_dot_product_attention`` computes the attention, grouped-query
    heads included. Masks mean what upstream means by them: ``"causal"`` is the last ``L`` of ``S`` positions
    (upstream's own boolean mask), a boolean mask keeps ``True``, an additive one is added; ``align`` is
    upstream's own mask alignment where it has one (mlx-vlm's ``align_attention_mask_to_scores`` reads a 3-axis
    mask as ``(B, L, S)``), given 4-axis scores. Cost: one layer's keys and values in floating point while that
    layer runs (freed after), the memory a plain cache holds for every layer; no host synchronisation.
    """
    import mlx.core as mx

    dequantize, attention = mx.dequantize, mx.fast.scaled_dot_product_attention
    scores_rank = type("Scores", (), {"ndim": 4})()  # what ``align`` reads of the scores: their rank

    def quantized_scaled_dot_product_attention(
        queries: Any,
        q_keys: Any,
        q_values: Any,
        scale: float,
        mask: Any,
        group_size: int = 64,
        bits: int = 8,
    ) -> Any:
        keys = dequantize(*q_keys, group_size=group_size, bits=bits).astype(queries.dtype)
        values = dequantize(*q_values, group_size=group_size, bits=bits).astype(queries.dtype)
        if isinstance(mask, str):  # "causal": the queries are the last L of the S positions
            L, S = queries.shape[-2], keys.shape[-2]
            mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
        elif mask is not None and align is not None:
            mask = align(mask, scores_rank)
        if mask is not None and mask.dtype != mx.bool_:
            mask = mask.astype(queries.dtype)
        return attention(queries, keys, values, scale=scale, mask=mask)

    return quantized_scaled_dot_product_attention


def routed(original: Any) -> Any:
    """The replacement of upstream's quantized attention ``original``: itself where mlx computes every layout
    (CPU, Metal), :func:`dequantized_attention` with ``original``'s mask alignment where CUDA is there. Decided by
    CUDA being there, not by the default device: a verification process computes on the CPU by default (its
    reproduction of this bug runs on the GPU), and a program may pick its device after the import."""
    import mlx.core as mx

    if not cuda_available(mx):
        return original
    return dequantized_attention(upstream_align(original))


def upstream_align(function: Any) -> Any:
    """The mask alignment of ``function``'s module (mlx-vlm's ``align_attention_mask_to_scores``), or None."""
    import sys

    module = sys.modules.get(getattr(function, "__module__", None) or "")
    return getattr(module, "align_attention_mask_to_scores", None)


def sliced_quantized(
    mx: Any, shape: tuple[int, int, int, int], key: int, dtype: Any, group_size: int, bits: int
) -> Any:
    """Quantized ``(B, H, S, D)`` data as the quantized caches hand it out: the first S rows of a 256-row buffer."""
    B, H, S, D = shape
    full = mx.random.normal((B, H, 256, D), key=mx.random.key(key)).astype(dtype)
    return tuple(a[..., :S, :] for a in mx.quantize(full, group_size=group_size, bits=bits))


def reference(
    mx: Any, queries: Any, q_keys: Any, q_values: Any, scale: float, mask: Any, group_size: int, bits: int
) -> Any:
    """Float attention over the dequantized keys/values, each query head on its KV head (float32)."""
    keys = mx.dequantize(*q_keys, group_size=group_size, bits=bits).astype(mx.float32)
    values = mx.dequantize(*q_values, group_size=group_size, bits=bits).astype(mx.float32)
    rep = queries.shape[1] // keys.shape[1]
    keys, values = mx.repeat(keys, rep, axis=1), mx.repeat(values, rep, axis=1)
    scores = (queries.astype(mx.float32) * scale) @ keys.swapaxes(-1, -2)
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    return mx.softmax(scores, axis=-1) @ values


def check(function: Any, where: str) -> Finding:
    """Cache-like quantized attention through ``function`` on the backend, against a float reference: the bug where a
    geometry raises for want of a kernel or is clearly wrong (CUDA's wrong results measured 16 to 1e38, or NaN,
    against softmax-weighted values of unit scale), inconclusive where it is off by more than rounding but not
    clearly (:func:`~kvpatch.patches._numbers.judge`)."""
    import mlx.core as mx

    if not on_cuda(mx):
        return Finding(
            False,
            skipped=f"CUDA-only bug: mlx computes on the {backend(mx)} backend here, whose quantized_matmul "
            "takes every layout",
        )
    gs, bits, D = 64, 8, 64
    problems, found = [], []
    # (rows, query heads, KV heads, query length, keys): GQA prefill and decode, MHA decode, a batch; key counts
    # of 12 and 64 are where CUDA's kernels compute wrong numbers rather than raise
    for B, n_q, n_kv, L, S in ((1, 8, 2, 7, 7), (1, 8, 2, 1, 39), (3, 4, 2, 1, 12), (1, 4, 4, 2, 64), (2, 4, 1, 3, 7)):
        queries = mx.random.normal((B, n_q, L, D), key=mx.random.key(1))
        q_keys = sliced_quantized(mx, (B, n_kv, S, D), 2, mx.float32, gs, bits)
        q_values = sliced_quantized(mx, (B, n_kv, S, D), 3, mx.float32, gs, bits)
        # an additive causal mask (every release handles those; boolean and "causal" masks are mask-fill's bug)
        causal = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
        mask = mx.where(causal, 0.0, -1e9) if L > 1 else None
        what = f"{B} row(s), {n_q}q/{n_kv}kv heads, L={L}, S={S}"
        try:
            # ``queries + 0``: upstream scales its queries in place.
            out = function(queries + 0, q_keys, q_values, scale=D**-0.5, mask=mask, group_size=gs, bits=bits)
            ref = reference(mx, queries, q_keys, q_values, D**-0.5, mask, gs, bits)
            if out.shape != ref.shape:
                return Finding(False, inconclusive=f"{where}: {what}: output shape {out.shape}, expected {ref.shape}")
            found.append(difference(out, ref, where=what))
        except RuntimeError as exc:
            problems.append(f"{what}: {symptom(exc, NO_KERNEL)}")
    return judge(
        worst(found),
        f"{where} computes wrong results on CUDA against the float reference",
        f"{where}: all five cache-like geometries run and match the reference",
        problems=[f"{where} fails on CUDA: {p}" for p in problems],
    )
