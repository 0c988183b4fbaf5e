"""tq-value-kernels-metal (catalogue M3, Metal only): one-query TurboQuant value kernels ignore the Hadamard rotation.

Broken: for one-query decode, ``_TurboQuantMSECodec.weighted_sum`` and ``weighted_sum_stats_from_scores``
first try the Metal kernels behind ``mlx_vlm.turboquant._metal_mse_weighted_sum`` and
``_metal_mse_weighted_sum_sum_from_scores``. Those compute the attention-weighted value sum in the codec's
rotated space and map it back with ``matmul(weighted_rot, rotation)``, which is the inverse of the codec's
dense rotation only. From mlx-vlm 0.4.4 (90732bde, #909) the MSE codec rotates with a randomized Hadamard
transform whenever the head dim is a power of two (``use_rht``; its ``rotation`` matrix is then an unrelated
random orthogonal matrix), so the output is uncorrelated with the right answer: upstream measured ~140%
reconstruction error at every bit depth. The path is the masked (array-mask) decode that continuous
batching with per-request left padding uses. Upstream first skipped the kernels under RHT
(Blaizzy/mlx-vlm#1244, 3ef17cbc), then made them apply the RHT inverse (#1252, 1090328a); both are in 0.6.0.

Metal only: both functions return ``None`` without a Metal device and the codec uses its einsum path with
``_rotate_inverse``, which is correct. Not measured here (Linux CPU). What was measured, on the installed
wheels 0.4.4 and 0.5.0: every ``_TurboQuantMSECodec`` has ``use_rht`` exactly when its dim is a power of
two, the two functions have one caller each (those codec methods, which pass ``self.rotation``), and
0.6.0 carries the fix (``signs`` parameter). With the kernels' output emulated on CPU (own tests; the
emulation matches the einsum path exactly on a dense codec), the unpatched functions are off by a relative
error of 1.26 (one query head per KV head) and 1.42 (two) under RHT at head dim 64, 4 bits; the patched
ones give the einsum path's result exactly.
Range 0.4.4–0.5.0, as catalogued.

Fix: a delta in front of each function: when the rotation is that of an RHT codec (square, power-of-two
size: in these releases the codec's own rule for ``use_rht``, and the functions are handed no other
rotation), answer ``None``, the functions' own "no kernel here" answer, so the codec takes upstream's
einsum + ``_rotate_inverse`` path; otherwise call the original, which stays correct for dense rotations.
One integer test on a shape per call; no host synchronisation. The two functions are only called by
their global names inside ``mlx_vlm.turboquant`` (no module imports them by name; the engine would rebind
such aliases), so replacing the module attributes reaches every caller.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _reproduce
from kvpatch.patches._numbers import difference, judge, worst
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="tq-value-kernels-metal",
    summary="TurboQuant one-query value kernels undo a dense rotation where the codec used Hadamard (Metal)",
    distribution="mlx-vlm",
    affected=">=0.4.4,<0.6.0",
    fixed_in="0.6.0",
    fixed_commit="1090328a",
    introduced_commit="90732bde",
    reference="Blaizzy/mlx-vlm#1252",
    catalogue="M3",
    hot_path=True,
    metal_only=True,
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-vlm < 0.6.0 (and git pins before 1090328a)",
        review_by=_dt.date(2027, 6, 1),
    ),
)


@PATCH.replace("mlx_vlm.turboquant", "_metal_mse_weighted_sum")
def _build_weighted_sum(original: Any) -> Any:
    def _metal_mse_weighted_sum(weights: Any, state: Any, bits: int, codebook: Any, rotation: Any) -> Any:
        dim = rotation.shape[0]
        if dim & (dim - 1) == 0:
            return None
        return original(weights, state, bits, codebook, rotation)

    return _metal_mse_weighted_sum


@PATCH.replace("mlx_vlm.turboquant", "_metal_mse_weighted_sum_sum_from_scores")
def _build_sum_from_scores(original: Any) -> Any:
    def _metal_mse_weighted_sum_sum_from_scores(
        scores: Any, state: Any, bits: int, codebook: Any, rotation: Any, max_scores: Any
    ) -> Any:
        dim = rotation.shape[0]
        if dim & (dim - 1) == 0:
            return None
        return original(scores, state, bits, codebook, rotation, max_scores)

    return _metal_mse_weighted_sum_sum_from_scores


def measure() -> Finding:
    """Masked one-query TurboQuant decode (head dim 64, 4 bits; 2 and 1 query heads per KV head) against
    attention over the dequantized cache. Runs on any backend (on CPU the value kernels never run); the
    reproduction only calls it where they can."""
    import mlx.core as mx
    from mlx_vlm.turboquant import TurboQuantKVCache

    mx.random.seed(0)
    dim, tokens = 64, 17
    found = []
    for n_q_heads in (4, 2):
        cache = TurboQuantKVCache(bits=4)
        keys, values = mx.random.normal((1, 2, tokens, dim)), mx.random.normal((1, 2, tokens, dim))
        k_state, v_state = cache.update_and_fetch(keys, values)
        k_ref, v_ref = cache.dequantize(k_state, v_state)
        queries = mx.random.normal((1, n_q_heads, 1, dim))
        mask = mx.arange(tokens)[None, None, None, :] >= 3  # a left-padded row: an array mask
        out = cache.decode_attention(queries, k_state, v_state, scale=dim**-0.5, mask=mask)
        ref = mx.fast.scaled_dot_product_attention(
            queries, k_ref.astype(queries.dtype), v_ref.astype(queries.dtype), scale=dim**-0.5, mask=mask
        )
        found.append(difference(out, ref, where=f"{n_q_heads // 2} query heads per KV head"))
    what = "masked one-query decode vs attention over the dequantized cache"
    return judge(worst(found), f"{what}: different", f"{what}: equal")


@PATCH.reproduce
def reproduce() -> Finding:
    return _reproduce.on_turboquant_metal(measure, "the one-query value kernels run", "einsum path")
