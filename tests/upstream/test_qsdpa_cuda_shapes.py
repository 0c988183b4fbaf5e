"""qsdpa-cuda-shapes / vlm-qsdpa-cuda-shapes: the replacement is the same attention, on every backend.

The patches install the replacement only on CUDA, but what it computes can be checked anywhere: built explicitly
(with the upstream module's own mask alignment), it must match a float reference over every mask form callers pass
(none, ``"causal"``, boolean and additive, shared by all heads or one per query head, 2 to 4 axes), grouped-query
and plain multi-head attention, strided (cache-like) and contiguous keys, one row and several. On CUDA the
installed function itself is checked the same way (that it no longer raises is the reproduction's part).
"""

from __future__ import annotations

import importlib

import pytest

from kvpatch import registry
from kvpatch.patches import _cuda
from kvpatch.testing import difference, require_affected

mx = pytest.importorskip("mlx.core")

PATCHES = {p.id: p for p in registry.load().patches}
# (rows, query heads, KV heads, query length, keys)
GEOMETRIES = [(1, 8, 2, 5, 9), (2, 4, 1, 3, 7), (3, 4, 2, 1, 12), (2, 4, 4, 3, 7)]
MASKS = ["none", "causal", "bool-2d", "bool-b1", "additive-b1", "bool-per-head", "additive-per-head", "bool-3d"]


def _function(patch_id: str):
    patch = PATCHES[patch_id]
    require_affected(patch)
    module = importlib.import_module(next(t.module for t in patch.targets if not t.optional))
    return module.quantized_scaled_dot_product_attention


def _mask(kind: str, B: int, n_q: int, L: int, S: int):
    causal = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    padding = mx.arange(S)[None] >= mx.array([0, 2, 1][:B])[:, None]  # left padding per row
    row = causal[None] & padding[:, None]  # (B, L, S)
    heads = mx.random.bernoulli(0.7, (B, n_q, L, S), key=mx.random.key(7))
    per_head = heads & row[:, None] | (mx.arange(S) == S - 1)  # every query keeps at least its last key
    return {
        "none": None,
        "causal": "causal",
        "bool-2d": causal,
        "bool-b1": row[:, None],
        "additive-b1": mx.where(row[:, None], 0.0, -1e9),
        "bool-per-head": per_head,
        "additive-per-head": mx.where(per_head, 0.0, -1e9),
        "bool-3d": causal[None],
    }[kind]


def _explicit(mask, L: int, S: int):
    if isinstance(mask, str):
        return mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    return mask


@pytest.mark.parametrize("sliced", [True, False], ids=["cache-view", "contiguous"])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "B{}-{}q{}kv-L{}-S{}".format(*g))
@pytest.mark.parametrize("patch_id", ["qsdpa-cuda-shapes", "vlm-qsdpa-cuda-shapes"])
def test_replacement_matches_reference(patch_id, geometry, mask_kind, sliced):
    function = _function(patch_id)
    # the installed replacement where it is in (CUDA), else the same replacement built around upstream
    if getattr(function, "__kvpatch__", None):
        routed = function
    else:
        routed = _cuda.dequantized_attention(_cuda.upstream_align(function))
    B, n_q, n_kv, L, S = geometry
    D, gs, bits = 64, 64, 8
    queries = mx.random.normal((B, n_q, L, D), key=mx.random.key(1))
    if sliced:
        q_keys = _cuda.sliced_quantized(mx, (B, n_kv, S, D), 2, mx.float32, gs, bits)
        q_values = _cuda.sliced_quantized(mx, (B, n_kv, S, D), 3, mx.float32, gs, bits)
    else:
        q_keys = mx.quantize(mx.random.normal((B, n_kv, S, D), key=mx.random.key(2)), group_size=gs, bits=bits)
        q_values = mx.quantize(mx.random.normal((B, n_kv, S, D), key=mx.random.key(3)), group_size=gs, bits=bits)
    mask = _mask(mask_kind, B, n_q, L, S)
    out = routed(queries + 0, q_keys, q_values, scale=D**-0.5, mask=mask, group_size=gs, bits=bits)
    ref = _cuda.reference(mx, queries, q_keys, q_values, D**-0.5, _explicit(mask, L, S), gs, bits)
    assert out.shape == (B, n_q, L, D)
    found = difference(out, ref, where=f"{mask_kind} mask against the float reference")
    assert found.within, found


def test_builder_declines_off_cuda():
    """Off CUDA nothing is installed; on CUDA the installed function is the replacement."""
    for patch_id in ("qsdpa-cuda-shapes", "vlm-qsdpa-cuda-shapes"):
        patch = PATCHES[patch_id]
        target = next(t for t in patch.targets if not t.optional)
        original = object()
        built = patch.builders[target](original)
        assert (built is original) == (not _cuda.cuda_available(mx)), patch_id


def test_builder_routes_wherever_cuda_is_there_whatever_the_default_device():
    """A verification process computes on the CPU by default while its reproduction of this bug runs on the GPU: the
    patch it measures is the one a program on the GPU installs (the builder declined there: "bug present, patch not
    applied (not needed)" on the GPU machine)."""
    if not _cuda.cuda_available(mx):
        pytest.skip("needs MLX's CUDA backend (the builder returns the original without it)")
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        for patch_id in ("qsdpa-cuda-shapes", "vlm-qsdpa-cuda-shapes"):
            patch = PATCHES[patch_id]
            target = next(t for t in patch.targets if not t.optional)
            original = object()
            assert patch.builders[target](original) is not original, patch_id
    finally:
        mx.set_default_device(before)


def test_caller_queries_untouched():
    """Upstream scales its queries in place (``queries *= scale``); the replacement leaves them alone."""
    function = _function("qsdpa-cuda-shapes")
    routed = _cuda.dequantized_attention(_cuda.upstream_align(function))
    queries = mx.random.normal((1, 4, 2, 64), key=mx.random.key(1))
    before = mx.array(queries)
    q = mx.quantize(mx.random.normal((1, 2, 5, 64), key=mx.random.key(2)), group_size=64, bits=8)
    mx.eval(routed(queries, q, q, scale=0.125, mask=None, group_size=64, bits=8))
    assert mx.array_equal(queries, before).item()
