"""qsdpa-gqa-batch-mask (A3) composed with mask-fill (A1+A2) on mlx-lm's quantized attention.

Both patches change ``mlx_lm.models.base.quantized_scaled_dot_product_attention``: mask-fill (order 10) on
0.22.0-0.23.2, qsdpa-gqa-batch-mask (order 20) on 0.19.3-0.31.3. Whatever is installed in this process,
the function must give the float32 reference attention for boolean, additive and "causal" masks, with
and without grouped-query heads, batch 1 and 2. On 0.23.2 both patches are stacked (mask-fill innermost);
on 0.24.0-0.31.3 only qsdpa-gqa-batch-mask applies; on 0.32+ neither does and upstream must be right.
"""

from __future__ import annotations

import pytest

import kvpatch
from kvpatch.gate import Action
from kvpatch.patches.mlx_lm.mask_fill import PATCH as MASK_FILL
from kvpatch.patches.mlx_lm.qsdpa_gqa_batch_mask import PATCH
from kvpatch.testing import difference, import_targets, natural_decision, without

TARGET = "mlx_lm.models.base.quantized_scaled_dot_product_attention"
L_, S_, D_ = 3, 7, 64
HEADS = [(2, 2), (4, 1), (8, 2)]  # (query heads, KV heads): no GQA, GQA 4:1, GQA 4:1 with B == KV heads
LEFT_PADDING = {1: [1], 2: [0, 2]}


pytestmark = pytest.mark.requires_patch(PATCH.id)


def _mask_fill_missing() -> bool:
    """True on releases below mask-fill's range (0.19.3-0.21.x): boolean masks are A1-broken, unpatched."""
    return natural_decision(MASK_FILL).action is Action.OUT_OF_RANGE


def _inputs(batch: int, n_q: int, n_kv: int):
    import mlx.core as mx

    mx.random.seed(batch * 100 + n_q * 10 + n_kv)
    q = mx.random.normal((batch, n_q, L_, D_))
    k = mx.random.normal((batch, n_kv, S_, D_))
    v = mx.random.normal((batch, n_kv, S_, D_))
    qk = mx.quantize(k, group_size=64, bits=8)
    qv = mx.quantize(v, group_size=64, bits=8)
    return q, qk, qv


def _keep(kind: str, batch: int):
    """The boolean "may attend" pattern every mask kind stands for: (B or 1, 1, L, S)."""
    import mlx.core as mx

    causal = mx.arange(S_ - L_, S_)[:, None] >= mx.arange(S_)[None]
    if kind == "causal":
        return causal[None, None]
    left_padding = mx.array(LEFT_PADDING[batch])
    return causal & (left_padding[:, None, None, None] <= mx.arange(S_))


def _mask(kind: str, batch: int):
    import mlx.core as mx

    if kind == "causal":
        return "causal"
    keep = _keep(kind, batch)
    if kind == "boolean":
        return keep
    return mx.where(keep, mx.array(0.0), mx.array(mx.finfo(mx.float32).min))


def _reference(q, qk, qv, keep):
    """float32 attention over the dequantized keys/values, masked slots filled with -inf."""
    import mlx.core as mx

    n_rep = q.shape[1] // qk[0].shape[1]
    k = mx.repeat(mx.dequantize(*qk, group_size=64, bits=8), n_rep, axis=1)
    v = mx.repeat(mx.dequantize(*qv, group_size=64, bits=8), n_rep, axis=1)
    scores = (q * D_**-0.5) @ k.swapaxes(-1, -2)
    scores = mx.where(keep, scores, -mx.inf)
    return mx.softmax(scores, axis=-1) @ v


def _difference(kind: str, batch: int, n_q: int, n_kv: int):
    from mlx_lm.models import base

    q, qk, qv = _inputs(batch, n_q, n_kv)
    reference = _reference(q, qk, qv, _keep(kind, batch))
    out = base.quantized_scaled_dot_product_attention(q + 0, qk, qv, D_**-0.5, _mask(kind, batch), 64, 8)
    assert out.shape == reference.shape
    return difference(out, reference, where=f"{kind} mask, batch {batch}, {n_q}q/{n_kv}kv heads")


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("heads", HEADS, ids=[f"{q}q{k}kv" for q, k in HEADS])
@pytest.mark.parametrize("kind", ["boolean", "additive", "causal"])
def test_matches_float_reference(kind, heads, batch):
    if kind != "additive" and _mask_fill_missing():
        pytest.skip("below mask-fill's range boolean/'causal' masks have A1's bug, which no patch covers there")
    n_q, n_kv = heads
    assert _difference(kind, batch, n_q, n_kv).within


def test_stacking_order():
    """Where both apply they are both installed, mask-fill first (innermost), this patch on top."""
    engine = kvpatch.get_engine()
    if natural_decision(MASK_FILL).action is not Action.APPLY:
        pytest.skip(f"mask-fill does not apply here: {natural_decision(MASK_FILL).reason}")
    import_targets(MASK_FILL)
    order = [pid for pid, path in engine.changes() if path == TARGET and pid in (MASK_FILL.id, PATCH.id)]
    assert order == [MASK_FILL.id, PATCH.id]


def test_each_patch_alone_keeps_its_fix():
    """Taking either patch out (the engine re-stacks the other on the original) keeps the other's fix."""
    if natural_decision(PATCH).action is not Action.APPLY:
        pytest.skip(f"{PATCH.id}: {natural_decision(PATCH).reason}")
    with without(MASK_FILL.id):
        assert _difference("additive", 2, 8, 2).within  # A3 fixed, with or without mask-fill
        assert _difference("additive", 2, 4, 1).within
    if natural_decision(MASK_FILL).action is Action.APPLY:
        with without(PATCH.id):
            assert _difference("boolean", 1, 4, 1).within  # A1 fixed by mask-fill alone (batch 1: no A3)
            assert _difference("causal", 2, 8, 2).within  # "causal" is not per-row: no A3


def test_per_query_head_mask_is_regrouped():
    """A (B, H_q, L, S) mask (one slice per query head) is regrouped per KV head, not only broadcast.

    Beyond upstream's own fix (0.32.0 handles only a head axis of 1), so this runs where the patch is on.
    """
    import mlx.core as mx
    from mlx_lm.models import base

    if natural_decision(PATCH).action is not Action.APPLY:
        pytest.skip(f"{PATCH.id}: {natural_decision(PATCH).reason}")
    q, qk, qv = _inputs(2, 8, 2)
    keep = _keep("additive", 2) & mx.random.bernoulli(0.7, (2, 8, L_, S_))
    keep = keep | (mx.arange(S_) == S_ - L_ + mx.arange(L_)[:, None])  # every query keeps its own position
    mask = mx.where(keep, mx.array(0.0), mx.array(-mx.inf))
    out = base.quantized_scaled_dot_product_attention(q + 0, qk, qv, D_**-0.5, mask, 64, 8)
    found = difference(out, _reference(q, qk, qv, keep))
    assert found.within, found
