"""left-padding-mask (catalogue V01): batch quantized / TurboQuant caches build masks that ignore left padding.

Broken: in mlx-vlm 0.5.0 ``make_mask`` of ``mlx_vlm.models.cache.BatchQuantizedKVCache`` and of
``mlx_vlm.turboquant.BatchTurboQuantKVCache`` forwards the per-row ``offset`` array to mlx-lm's
``create_attention_mask(N, offset, return_array, window_size)``, which expects one integer. For a
left-padded batch it returns ``None`` for N=1 and ``"causal"`` for N>1, so padded rows attend to their pad
tokens (the batched logits of a tiny model differ from single-sequence logits), and with
``return_array=True`` or a window it raises ``TypeError: arange(): incompatible function arguments``.

Measured (Linux, mlx[cpu], mlx-lm 0.31.3): present in mlx-vlm 0.5.0, absent in 0.6.0 and 0.7.10. Both
classes first appear in 0.5.0 (git b0275383, #1030; 0.4.4 has neither). Upstream fix:
Blaizzy/mlx-vlm#1208 (2a55b80b), released in 0.6.0.

Fix: the mask is built the way mlx-lm's ``BatchKVCache.make_mask`` builds it, by calling mlx-lm's public
``create_causal_mask(N, offset=<the cache's integer write index _idx>, window_size=...,
left_padding=<the per-row left_padding array>)``: a boolean (B, 1, N, _idx + N) mask that hides each row's
pad slots. The original is not called: everything it computes comes from the per-row offset array it must
not use. Like mlx-lm's BatchKVCache the result is always an array (``return_array`` is accepted and has
nothing left to decide: a string or ``None`` cannot express per-row padding). ``make_mask`` runs once per
forward pass (per step): the replacement is a plain function with no host synchronisation; the helper is
looked up once when the patch is installed.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _reproduce
from kvpatch.patches._numbers import exact
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="left-padding-mask",
    summary="batch quantized/TurboQuant make_mask passes the per-row offset array on: left padding not masked",
    distribution="mlx-vlm",
    affected=">=0.5.0,<0.6.0",
    fixed_in="0.6.0",
    fixed_commit="2a55b80b",
    introduced_commit="b0275383",
    reference="Blaizzy/mlx-vlm#1208",
    catalogue="V01",
    hot_path=True,
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-vlm < 0.6.0 (and git pins before 2a55b80b)",
        review_by=_dt.date(2027, 6, 1),
    ),
)


@PATCH.replace("mlx_vlm.models.cache", "BatchQuantizedKVCache.make_mask")
@PATCH.replace("mlx_vlm.turboquant", "BatchTurboQuantKVCache.make_mask")
def _build(original: Any) -> Any:  # the original is not called: see the module docstring
    from mlx_lm.models.base import create_causal_mask

    def make_mask(self: Any, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        return create_causal_mask(N, offset=self._idx, window_size=window_size, left_padding=self.left_padding)

    return make_mask


@PATCH.reproduce
def reproduce() -> Finding:
    """Masks of left-padded batch quantized and TurboQuant caches (prefill and decode, with and without
    ``return_array`` and a window) against the mask that hides each row's pad slots."""
    import mlx.core as mx

    try:
        from mlx_vlm.models.cache import BatchQuantizedKVCache
        from mlx_vlm.turboquant import BatchTurboQuantKVCache
    except ImportError as exc:
        return _reproduce.absent(exc, "this mlx-vlm has no BatchQuantizedKVCache / BatchTurboQuantKVCache")

    mx.random.seed(0)
    H, D, T = 2, 32, 4
    left_padding = [2, 0]
    lp = mx.array(left_padding)

    def expected(idx: int, n: int, window: int | None) -> Any:
        q = mx.arange(idx, idx + n)[:, None]
        k = mx.arange(idx + n)[None]
        keep = (k <= q) & (k >= lp[:, None, None, None])
        if window is not None:
            keep = keep & (k > q - window)
        return keep

    caches = {
        "BatchQuantizedKVCache": BatchQuantizedKVCache(left_padding, group_size=32, bits=8),
        "BatchTurboQuantKVCache": BatchTurboQuantKVCache(left_padding, bits=4),
    }
    keys, values = mx.random.normal((2, H, T, D)), mx.random.normal((2, H, T, D))
    problems = []
    cases = [
        ("prefill", T, False, None),
        ("decode", 1, False, None),
        ("decode", 1, True, None),
        ("decode", 3, True, None),
        ("decode", 3, False, 2),
    ]
    for name, cache in caches.items():
        for stage, n, return_array, window in cases:
            if stage == "decode" and cache.empty():
                cache.update_and_fetch(keys, values)
            label = f"{name} {stage} N={n} return_array={return_array} window={window}"
            try:
                mask = cache.make_mask(n, return_array=return_array, window_size=window)
            except TypeError as exc:  # the bug's own error: the offset array handed to mx.arange
                symptom(exc, "arange(): incompatible function arguments")
                problems.append(f"{label}: raises TypeError (arange() given an array)")
                continue
            ref = expected(cache._idx, n, window)
            if mask is None or isinstance(mask, str):
                problems.append(f"{label}: {mask!r} (pad slots of row 0 not masked)")
                continue
            full = mx.broadcast_to(mask, ref.shape) if mask.ndim <= ref.ndim else mask
            if not exact(full, ref):
                problems.append(f"{label}: mask {tuple(mask.shape)} differs from the padded causal mask")
    if problems:
        return Finding(True, f"{len(problems)} wrong masks: " + "; ".join(problems))
    return Finding(False, "prefill and decode masks of both caches hide the pad slots (equal to the reference)")
