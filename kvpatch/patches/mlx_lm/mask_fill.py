"""mask-fill (catalogue A1+A2): quantized attention adds a boolean mask instead of filling with -inf.

Broken: in mlx-lm 0.22.0–0.23.2 ``mlx_lm.models.base.quantized_scaled_dot_product_attention`` does
``scores += mask``. With a boolean mask that adds 1 to kept and 0 to masked scores, so every query
attends to future and padded keys whenever a QuantizedKVCache is used (``--kv-bits``). From 0.22.2
models pass the string mask ``"causal"`` on multi-token steps, and ``scores += "causal"`` raises
``ValueError``.

Upstream: ml-explore/mlx-lm#121 (a9e1e82c), released in 0.24.0.

Fix: a delta in front of the original. The mask is turned into the additive form the original handles
correctly: ``"causal"`` becomes a boolean causal mask sized from the query and key lengths (queries are
the last ``L`` of ``S`` positions), and a boolean mask becomes 0 where kept and the dtype's most
negative finite value where masked. Additive masks pass through untouched, so models that already
build additive masks see no change. No host synchronisation is added.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches._numbers import difference, judge, worst
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="mask-fill",
    summary="quantized SDPA adds a boolean mask to the scores (and raises on 'causal') instead of masking",
    distribution="mlx-lm",
    affected=">=0.22.0,<0.24.0",
    fixed_in="0.24.0",
    fixed_commit="a9e1e82c",
    reference="ml-explore/mlx-lm#121",
    catalogue="A1+A2",
    hot_path=True,
    order=10,
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-lm < 0.24.0",
        review_by=_dt.date(2027, 6, 1),
    ),
)


@PATCH.replace("mlx_lm.models.base", "quantized_scaled_dot_product_attention")
def _build(original: Any) -> Any:
    import mlx.core as mx

    def quantized_scaled_dot_product_attention(
        queries: Any, q_keys: Any, q_values: Any, scale: float, mask: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if mask is not None:
            if isinstance(mask, str):
                q_len, k_len = queries.shape[-2], q_keys[0].shape[-2]
                mask = mx.arange(k_len - q_len, k_len)[:, None] >= mx.arange(k_len)[None]
            if mask.dtype == mx.bool_:
                mask = mx.where(mask, mx.array(0, queries.dtype), mx.array(mx.finfo(queries.dtype).min, queries.dtype))
        return original(queries, q_keys, q_values, scale, mask, *args, **kwargs)

    return quantized_scaled_dot_product_attention


@PATCH.reproduce
def reproduce() -> Finding:
    """Compare quantized attention under a causal boolean mask (and "causal") with a float reference."""
    import mlx.core as mx
    from mlx_lm.models import base

    mx.random.seed(0)
    B, H, L, D = 1, 2, 6, 64
    q = mx.random.normal((B, H, L, D))
    k = mx.random.normal((B, H, L, D))
    v = mx.random.normal((B, H, L, D))
    qk = mx.quantize(k, group_size=64, bits=8)
    qv = mx.quantize(v, group_size=64, bits=8)
    k_ref = mx.dequantize(*qk, group_size=64, bits=8)
    v_ref = mx.dequantize(*qv, group_size=64, bits=8)
    causal = mx.arange(L)[:, None] >= mx.arange(L)[None]
    scale = D**-0.5
    scores = (q * scale) @ k_ref.swapaxes(-1, -2)
    scores = mx.where(causal, scores, -mx.inf)
    reference = mx.softmax(scores, axis=-1) @ v_ref

    problems, found = [], []
    # ``q + 0``: the upstream function scales its queries in place (mlx's ``*=``), so each call gets a copy.
    out = base.quantized_scaled_dot_product_attention(q + 0, qk, qv, scale=scale, mask=causal, group_size=64, bits=8)
    found.append(difference(out, reference, where="boolean mask"))
    try:
        out = base.quantized_scaled_dot_product_attention(
            q + 0, qk, qv, scale=scale, mask="causal", group_size=64, bits=8
        )
        found.append(difference(out, reference, where='"causal" mask'))
    except ValueError as exc:  # the bug's own error: the "causal" string added to the scores
        problems.append(f'"causal" mask raises ValueError: {symptom(exc, "Cannot perform inplace addition")}')
    return judge(
        worst(found),
        "quantized attention differs from the masked float reference",
        "boolean and 'causal' masks match the float reference",
        problems=problems,
    )
