"""tq-fused-quantize-metal (M2) on a backend without Metal: the patched cache never consults the fused K/V
quantize kernel for Hadamard codecs (the unpatched one does: on Metal that is the bug), keeps it for dense
codecs, and stores bit-identical states and decodes identically to the unpatched CPU path."""

from __future__ import annotations

import pytest

import kvpatch
from kvpatch.patches.mlx_vlm.tq_fused_quantize_metal import PATCH, measure
from kvpatch.testing import without

pytestmark = pytest.mark.requires_patch(PATCH.id, needed=True)


@pytest.fixture
def tq():
    from mlx_vlm import turboquant

    if turboquant._metal_available():
        pytest.skip("Metal is available: the reproduction itself measures the real kernel")
    return turboquant


@pytest.fixture
def factory_calls(tq, monkeypatch):
    """Record every request for the fused kernel; answer with upstream's own factory (None on CPU)."""
    calls = []
    real = tq._fused_kv_quantize_kernel

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(tq, "_fused_kv_quantize_kernel", spy)
    return calls


def _decode_run(tq, dim, steps=3):
    """Prefill 8 tokens, decode ``steps`` one at a time; return the final states (as arrays), their
    dequantized keys/values and a masked one-query attention output."""
    import mlx.core as mx

    mx.random.seed(dim)
    cache = tq.TurboQuantKVCache(bits=4)
    keys, values = mx.random.normal((1, 2, 8 + steps, dim)), mx.random.normal((1, 2, 8 + steps, dim))
    k_state, v_state = cache.update_and_fetch(keys[:, :, :8], values[:, :, :8])
    for i in range(8, 8 + steps):
        k_state, v_state = cache.update_and_fetch(keys[:, :, i : i + 1], values[:, :, i : i + 1])
    k, v = cache.dequantize(k_state, v_state)
    mask = mx.arange(8 + steps)[None, None, None, :] >= 2
    out = cache.decode_attention(mx.random.normal((1, 4, 1, dim)), k_state, v_state, scale=dim**-0.5, mask=mask)
    arrays = [a for s in (k_state, v_state) for a in (s.norms, s.indices)]
    return arrays, [k, v, out]


def test_hadamard_codec_skips_the_fused_kernel(tq, factory_calls):
    if not kvpatch.get_engine().status[PATCH.id].installed:
        pytest.skip("patch not installed in this process")
    _decode_run(tq, 64)
    assert factory_calls == [], f"patched cache requested the fused kernel: {factory_calls}"
    with without(PATCH.id):
        _decode_run(tq, 64)
    assert factory_calls, "unpatched cache did not request the fused kernel for a one-token update"


def test_dense_codec_keeps_the_fused_kernel(tq, factory_calls):
    _decode_run(tq, 80)
    assert factory_calls, "a dense-rotation codec (dim 80) must keep the fused path"


@pytest.mark.parametrize("dim", [64, 80])
def test_same_numbers_as_the_unpatched_cpu_path(tq, dim):
    import mlx.core as mx

    states, results = _decode_run(tq, dim)
    with without(PATCH.id):
        ref_states, ref_results = _decode_run(tq, dim)
    for a, b in zip(states, ref_states, strict=True):
        assert mx.array_equal(a, b).item()
    for a, b in zip(results, ref_results, strict=True):
        assert mx.array_equal(a, b).item()


def test_measure_runs_and_is_clean_here(tq):
    finding = measure()
    assert finding.bug == "absent", (finding.bug, finding.detail, finding.inconclusive)
