"""vlm-qsdpa-batch-mask (catalogue V08): mlx-vlm's quantized attention lines a batch mask up with the KV heads.

Broken: with grouped-query attention, ``quantized_scaled_dot_product_attention`` reshapes the queries to
five axes ``(B, n_kv_heads, n_repeats, L, D)``, so the scores are ``(B, n_kv_heads, n_repeats, L, K)``. The
batch caches' ``make_mask`` returns a per-row mask ``(B, 1, L, K)`` (left padding), which mlx broadcasts
right-aligned: ``B`` lands on the KV-head axis and the head axis on the batch axis. Measured (Linux,
mlx[cpu]; 4 query heads, head dim 64, 8 bits, left padding [0, 2] / [0, 2, 1]):

* B == n_kv_heads (2 rows, 2 KV heads): no error, but every row is masked with the other rows' padding
  interleaved over its heads: max error 2.13 (boolean mask) and 3.04 (additive) against a float32
  reference (the catalogue measured 1.84 on other data);
* B != n_kv_heads: ``ValueError: [broadcast_shapes] Shapes (3,1,3,6) and (3,2,2,3,6)`` (3 rows, 2 KV
  heads) or ``[reshape] Cannot reshape array of size 3072 into shape (2,4,3,64)`` (2 rows, 1 KV head).

This is every multi-row batch decode/prefill with ``--kv-bits`` (BatchQuantizedKVCache) in continuous
batching. Upstream fixed ``mlx_vlm.models.base`` in Blaizzy/mlx-vlm#1568 (c84cf87b, 0.6.5) by inserting
the singleton axes in front of ``(L, K)``.

Measured range differs from the catalogue (0.6.4 only): mlx-vlm 0.6.5 also ships
``mlx_vlm.models.text_models.base``, a second copy of the function that predates the fix (reintroduced by
893f659a, "vendor Qwen + DeepSeek text architectures natively"); it is what the text-only Qwen/DeepSeek
architectures (``text_models.qwen``, ``qwen2_moe``, ``qwen3_moe``, ``qwen3_next``, ``deepseek``,
``deepseek_v2``) call through their ``scaled_dot_product_attention``. It has the same bug in 0.6.5 (max
error 2.62 boolean / 2.85 additive in the reproduction, same crashes) and is gone in 0.6.6 (4dac60c6,
#1616, which moved those models into per-family packages on ``mlx_vlm.models.base``). So: affected
0.6.4–0.6.5, fixed in 0.6.6. mlx-vlm 0.6.3 and older have no
quantized attention of their own (they use mlx-lm's, catalogue A3).

Who calls it: inside each of the two modules only that module's ``scaled_dot_product_attention``, by
its global name at call time, so replacing the module attribute reaches every model; no mlx-vlm module
imports ``quantized_scaled_dot_product_attention`` by name in 0.6.4 or 0.6.5 (the engine would rebind it
if one did).

Fix: a delta in front of the original. When the query and KV head counts differ and the mask is a
4-axis array, the mask is given the 5-axis layout of the scores before the original sees it: a
``(B, 1, L, K)`` mask becomes ``(B, 1, 1, L, K)``, and a per-head ``(B, n_q_heads, L, K)`` mask becomes
``(B, n_kv_heads, n_repeats, L, K)`` (the same grouping the original applies to the queries). String,
2-axis and 5-axis masks, and plain multi-head attention, are passed through untouched. The original
then masks or adds exactly as before. On 0.6.5's ``models.base`` (already fixed) the mask arrives with
five axes and upstream's own alignment leaves it alone, so applying the delta there changes nothing.
Shapes only: no host synchronisation, no per-call gating.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import replace
from typing import Any

from kvpatch.patches import _qsdpa, _reproduce
from kvpatch.patches._numbers import Difference, difference, judge, worst
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="vlm-qsdpa-batch-mask",
    summary="mlx-vlm quantized SDPA broadcasts a (B,1,L,K) batch mask onto the KV-head axis of GQA scores",
    distribution="mlx-vlm",
    affected=">=0.6.4,<0.6.6",
    fixed_in="0.6.6",
    fixed_commit="4dac60c6",
    introduced_commit="a492e47d",
    reference="Blaizzy/mlx-vlm#1568",
    catalogue="V08",
    hot_path=True,
    order=10,
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-vlm < 0.6.6 (and git pins before 4dac60c6)",
        review_by=_dt.date(2027, 6, 1),
    ),
)


@PATCH.replace("mlx_vlm.models.base", "quantized_scaled_dot_product_attention")
@PATCH.replace("mlx_vlm.models.text_models.base", "quantized_scaled_dot_product_attention", optional=True)
def _build(original: Any) -> Any:
    return _qsdpa.regrouping(original)


def _case(module: Any, batch: int, n_kv_heads: int, additive: bool) -> str | Difference:
    """Run one geometry through ``module``'s quantized attention: the bug's own error, or the difference from the
    float32 reference."""
    import mlx.core as mx

    n_q_heads, q_len, k_len, dim = 4, 3, 6, 64
    queries = mx.random.normal((batch, n_q_heads, q_len, dim))
    keys = mx.random.normal((batch, n_kv_heads, k_len, dim))
    values = mx.random.normal((batch, n_kv_heads, k_len, dim))
    q_keys = mx.quantize(keys, group_size=64, bits=8)
    q_values = mx.quantize(values, group_size=64, bits=8)
    left_padding = mx.array([0, 2, 1][:batch])
    causal = mx.arange(k_len - q_len, k_len)[:, None] >= mx.arange(k_len)[None]
    mask = causal[None, None] & (mx.arange(k_len)[None, None, None] >= left_padding[:, None, None, None])
    scale = dim**-0.5

    # float32 reference: dequantized keys/values repeated per query head, masked softmax
    repeats = n_q_heads // n_kv_heads
    k_ref = mx.repeat(mx.dequantize(*q_keys, group_size=64, bits=8), repeats, axis=1)
    v_ref = mx.repeat(mx.dequantize(*q_values, group_size=64, bits=8), repeats, axis=1)
    scores = mx.where(mask, (queries * scale) @ k_ref.swapaxes(-1, -2), -mx.inf)
    reference = mx.softmax(scores, axis=-1) @ v_ref

    given = mx.where(mask, mx.array(0.0), mx.array(mx.finfo(mx.float32).min)) if additive else mask
    what = f"B={batch}, n_kv_heads={n_kv_heads}, {'additive' if additive else 'boolean'} (B,1,L,K) mask"
    try:
        # ``queries + 0``: the upstream function scales its queries in place.
        out = module.quantized_scaled_dot_product_attention(
            queries + 0, q_keys, q_values, scale=scale, mask=given, group_size=64, bits=8
        )
    except ValueError as exc:  # the bug's own error: the (B, 1, L, K) mask against grouped heads
        return f"{what}: raises ValueError: {symptom(exc, '[broadcast_shapes]', '[reshape] Cannot reshape')}"
    if out.shape != reference.shape:
        return f"{what}: output shape {out.shape}, the float32 reference's {reference.shape}"
    return difference(out, reference, where=what)


@PATCH.reproduce
def reproduce() -> Finding:
    """Quantized GQA attention under a per-row left-padding mask, against a float32 reference: the silent
    case (B == n_kv_heads) with a boolean and an additive mask, and B != n_kv_heads (3 rows / 1 KV head)."""
    import mlx.core as mx

    modules = _reproduce.vlm_quantized_attentions()
    if not modules:
        return Finding(False, "this mlx-vlm has no quantized attention of its own: nothing to fix")

    mx.random.seed(0)
    problems, found = [], []
    for name, module in modules:
        for batch, n_kv_heads, additive in ((2, 2, False), (2, 2, True), (3, 2, False), (2, 1, False)):
            case = _case(module, batch, n_kv_heads, additive)
            if isinstance(case, str):
                problems.append(f"{name}: {case}")
            else:
                found.append(replace(case, where=f"{name}: {case.where}"))
    names = ", ".join(name for name, _ in modules)
    return judge(
        worst(found),
        "quantized attention differs from the float32 reference",
        f"{names}: all four geometries match the float32 reference",
        problems=problems,
    )
