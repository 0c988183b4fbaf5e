"""qsdpa-gqa-batch-mask (catalogue A3): quantized attention misaligns a per-row mask under grouped-query heads.

Broken: with grouped-query attention (fewer KV heads than query heads) ``mlx_lm.models.base.
quantized_scaled_dot_product_attention`` computes 5-D scores ``(B, n_kv_heads, n_repeats, L, S)`` but
applies the caller's 4-D mask ``(B, 1, L, S)`` unchanged. Right-aligned against the 5-D scores the mask's
batch axis lands on the KV-head axis. Measured on mlx-lm 0.19.3, 0.21.5, 0.22.0–0.31.3 (CPU, additive and
boolean masks, batch 2 with left padding):

* ``B != n_kv_heads`` (and ``n_kv_heads == 1``): ``ValueError: [reshape] Cannot reshape array of size 3072
  into shape (2,4,3,64)``; other head counts give ``[broadcast_shapes] ... cannot be broadcast``;
* ``B == n_kv_heads``: no error, but row ``b``'s padding mask is applied to KV head ``b`` of every row:
  silently wrong attention, max error 1.87 against the float reference (8 query / 2 KV heads, batch 2).

Batch 1 and non-GQA models are unaffected. The per-row 4-D mask reaches this function from batch
quantized caches, e.g. mlx-vlm's ``BatchQuantizedKVCache`` on mlx-vlm 0.5.0–0.6.3, which re-export mlx-lm's
quantized attention. The function first appeared in mlx-lm 0.19.3 (absent in 0.19.2), with the bug.

Upstream: ml-explore/mlx-lm#1467 (a790972f), released in 0.32.0 (measured clean on 0.32.0 and 0.32.2).
The catalogue said "<= 0.31.3 (seen 0.22.0-0.31.3)"; the range here starts where the function appears.

Fix: a delta in front of the original. When the query and KV head counts differ and the mask is a 4-D
array, the mask gets the grouped-query layout of the scores: a mask shared by all heads ``(B, 1, L, S)``
becomes ``(B, 1, 1, L, S)``; a mask with one slice per query head ``(B, H_q, L, S)`` is regrouped to
``(B, n_kv_heads, n_repeats, L, S)`` (query head ``h`` uses KV head ``h // n_repeats``, the same grouping
as the queries' reshape). Anything else (``None``, ``"causal"``, 2-D/3-D masks, non-GQA calls) passes
through untouched. The change is shape-only: no host synchronisation, no copy of the mask data.

Composition: ``mask-fill`` (order 10) changes the same function on 0.22.0–0.23.2 (boolean and "causal"
masks). This patch has order 20, so it is installed on top: it regroups the mask, then ``mask-fill``
turns a boolean mask (of any rank) into an additive one, then the original runs.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _qsdpa
from kvpatch.patches._numbers import difference, judge, worst
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="qsdpa-gqa-batch-mask",
    summary="quantized SDPA with grouped-query heads applies a per-row (B,1,L,S) mask to the KV-head axis",
    distribution="mlx-lm",
    affected=">=0.19.3,<0.32.0",
    fixed_in="0.32.0",
    fixed_commit="a790972f",
    reference="ml-explore/mlx-lm#1467",
    catalogue="A3",
    hot_path=True,
    order=20,
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-lm < 0.32.0",
        review_by=_dt.date(2027, 6, 1),
    ),
)


@PATCH.replace("mlx_lm.models.base", "quantized_scaled_dot_product_attention")
def _build(original: Any) -> Any:
    return _qsdpa.regrouping(original)


@PATCH.reproduce
def reproduce() -> Finding:
    """Batch-2 grouped-query attention with a per-row additive padding mask against a float reference.

    An additive mask keeps this independent of ``mask-fill`` (boolean masks are A1's bug on 0.22-0.23).
    Two head layouts: 4 query / 1 KV head (upstream raises) and 8 query / 2 KV heads (batch == KV heads:
    upstream silently applies row b's mask to KV head b).
    """
    import mlx.core as mx
    from mlx_lm.models import base

    mx.random.seed(0)
    B, L, S, D = 2, 3, 7, 64
    left_padding = mx.array([0, 2])
    keep = (mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]) & (left_padding[:, None, None, None] <= mx.arange(S))
    mask = mx.where(keep, 0.0, -1e9)  # (B, 1, L, S)
    problems, found = [], []
    for n_q, n_kv in ((4, 1), (8, 2)):
        q = mx.random.normal((B, n_q, L, D))
        k = mx.random.normal((B, n_kv, S, D))
        v = mx.random.normal((B, n_kv, S, D))
        qk = mx.quantize(k, group_size=64, bits=8)
        qv = mx.quantize(v, group_size=64, bits=8)
        k_ref = mx.repeat(mx.dequantize(*qk, group_size=64, bits=8), n_q // n_kv, axis=1)
        v_ref = mx.repeat(mx.dequantize(*qv, group_size=64, bits=8), n_q // n_kv, axis=1)
        scores = (q * D**-0.5) @ k_ref.swapaxes(-1, -2) + mask
        reference = mx.softmax(scores, axis=-1) @ v_ref
        try:
            # ``q + 0``: upstream scales its queries in place.
            out = base.quantized_scaled_dot_product_attention(
                q + 0, qk, qv, scale=D**-0.5, mask=mask, group_size=64, bits=8
            )
        except ValueError as exc:  # the bug's own error: the (B, 1, L, S) mask against grouped heads
            detail = symptom(exc, "[reshape] Cannot reshape", "[broadcast_shapes]")
            problems.append(f"{n_q}q/{n_kv}kv heads raises ValueError: {detail}")
            continue
        if out.shape != reference.shape:
            problems.append(f"{n_q}q/{n_kv}kv heads: output shape {out.shape}, the float reference's {reference.shape}")
        else:
            found.append(difference(out, reference, where=f"{n_q}q/{n_kv}kv heads"))
    return judge(
        worst(found),
        "batch-2 GQA attention with a per-row mask differs from the float reference",
        "batch-2 GQA attention with a per-row mask matches the float reference",
        problems=problems,
    )
