"""Shared by qsdpa-cuda-shapes (mlx-lm) and vlm-qsdpa-cuda-shapes (mlx-vlm): quantized attention on MLX's CUDA
backend, routed to the operand layouts its ``quantized_matmul`` kernels accept.

Not a patch unit (the registry skips modules whose name starts with ``_``). Imports mlx lazily.
"""

from __future__ import annotations

from typing import Any

from kvpatch.record import Finding, symptom

#: How mlx's CUDA backend says it has no kernel for a ``quantized_matmul`` (mlx 0.32.4).
NO_KERNEL = "No implementation for problem shape"


def on_cuda(mx: Any) -> bool:
    """True when mlx computes on an NVIDIA GPU by default (``mx.cuda`` exists from mlx 0.28)."""
    cuda = getattr(mx, "cuda", None)
    try:
        available = bool(cuda is not None and cuda.is_available())
    except Exception:  # an mlx build whose cuda module cannot answer: not CUDA as far as we know
        return False
    return available and mx.default_device().type == mx.DeviceType.gpu


def backend(mx: Any) -> str:
    """The backend mlx computes on by default, in words (for skip reasons)."""
    if on_cuda(mx):
        return "CUDA"
    metal = getattr(mx, "metal", None)
    if metal is not None and metal.is_available() and mx.default_device().type == mx.DeviceType.gpu:
        return "Metal"
    return "CPU"


def routing(original: Any) -> Any:
    """``original`` (a quantized SDPA with upstream's signature) fed only operand layouts CUDA computes.

    * keys and values are made contiguous (``mx.contiguous``: no copy when they already are; the quantized
      caches hand out ``buffer[..., :offset, :]``, a strided view whenever batch x KV heads > 1);
    * grouped-query attention is folded into plain multi-head attention over the KV heads: queries
      ``(B, n_q, L, D)`` become ``(B, n_kv, n_rep * L, D)`` (the same grouping as upstream's own 5-axis
      reshape: query head ``h`` belongs to KV head ``h // n_rep``), the mask is laid out the same way, the
      original runs its 4-axis path (no broadcast batch axis), and the output is reshaped back.

    Shape logic only: no host synchronisation, nothing decided per call but the layout.
    """
    import mlx.core as mx

    contiguous = mx.contiguous

    def fold_mask(mask: Any, n_q: int, n_kv: int, length: int) -> Any:
        """``mask`` laid out for scores ``(..., n_kv, n_rep * L, S)``; ``None`` for a layout left to the original."""
        rep = n_q // n_kv
        if mask.ndim < 2 or mask.ndim > 4:
            return None
        s = mask.shape[-1]
        heads = mask.shape[-3] if mask.ndim >= 3 else 1
        if heads == n_q:  # one slice per query head: regroup like the queries
            lead = mask.shape[:-3]
            return mx.broadcast_to(mask, (*lead, n_q, length, s)).reshape(*lead, n_kv, rep * length, s)
        if heads != 1:
            return None
        lead = mask.shape[:-2]  # shared by all heads: repeat it for each query head of a group
        return mx.broadcast_to(mx.expand_dims(mask, -3), (*lead, rep, length, s)).reshape(*lead, rep * length, s)

    def quantized_scaled_dot_product_attention(
        queries: Any,
        q_keys: Any,
        q_values: Any,
        scale: float,
        mask: Any,
        group_size: int = 64,
        bits: int = 8,
    ) -> Any:
        q_keys = tuple(contiguous(a) for a in q_keys)
        q_values = tuple(contiguous(a) for a in q_values)
        B, n_q, L, D = queries.shape
        n_kv = q_keys[0].shape[-3]
        if n_q == n_kv or n_q % n_kv:
            return original(queries, q_keys, q_values, scale, mask, group_size, bits)
        if isinstance(mask, str):  # "causal": the queries are the last L of the S positions
            S = q_keys[0].shape[-2]
            mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
        if mask is not None:
            folded = fold_mask(mask, n_q, n_kv, L)
            if folded is None:
                return original(queries, q_keys, q_values, scale, mask, group_size, bits)
            mask = folded
        grouped = queries.reshape(B, n_kv, (n_q // n_kv) * L, D)
        out = original(grouped, q_keys, q_values, scale, mask, group_size, bits)
        return out.reshape(B, n_q, L, out.shape[-1])

    return quantized_scaled_dot_product_attention


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
    """Cache-like quantized attention through ``function`` on the backend, against a float reference."""
    import mlx.core as mx

    from kvpatch.testing import tolerance

    if not on_cuda(mx):
        return Finding(
            False,
            skipped=f"CUDA-only bug: mlx computes on the {backend(mx)} backend here, whose quantized_matmul "
            "takes every layout",
        )
    gs, bits, D = 64, 8, 64
    problems, worst = [], 0.0
    # (rows, query heads, KV heads, query length, keys): GQA prefill and decode, MHA decode, a batch
    for B, n_q, n_kv, L, S in ((1, 8, 2, 7, 7), (1, 8, 2, 1, 39), (1, 4, 4, 1, 39), (2, 4, 1, 3, 7)):
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
            err = mx.abs(out - ref).max().item()
        except RuntimeError as exc:
            problems.append(f"{what}: {symptom(exc, NO_KERNEL)}")
            continue
        if out.shape != ref.shape or err > tolerance():
            return Finding(False, inconclusive=f"{where}: {what}: runs but max error {err:.3g} against the reference")
        worst = max(worst, err)
    if problems:
        return Finding(True, f"{where} raises on CUDA: " + "; ".join(problems))
    return Finding(
        False, f"{where}: all four cache-like geometries run and match the reference (max error {worst:.2g})"
    )
