"""batch-quantized-extend (catalogue V02): batch quantized ``extend`` drops the rows of the side with no keys yet.

Broken: in mlx-vlm 0.5.0 ``mlx_vlm.models.cache.BatchQuantizedKVCache.extend`` has a shortcut for "one side
has no keys yet" that keeps only the other side's packed ``(weights, scales, biases)`` rows, while
``offset`` and ``left_padding`` are concatenated for both sides. The cache then holds B=1 rows for a batch
of 2 and the next decode step raises ``ValueError: Cannot broadcast array of shape (2,2,1,4) into shape
(1,2,1,4)`` (head dim 32, 4 bits; the last axis is the packed width head_dim*bits/32, so 16 for head dim 64
at 8 bits as in the catalogue), for both ``full.extend(empty)`` and ``empty.extend(full)``.

Measured (Linux, mlx[cpu], mlx-lm 0.31.3): present in mlx-vlm 0.5.0, absent in 0.6.0 and 0.7.10; the class
first appears in 0.5.0 (git b0275383, #1030), 0.4.4 has none. Upstream fix: Blaizzy/mlx-vlm#1248
(654caf4c), released in 0.6.0. The TurboQuant twin (V03, ``empty-tq-rows``) is still unfixed.

Fix: a delta after the original. The original's bookkeeping is right (``_idx`` becomes the longer side's
length, the empty side's ``left_padding`` is raised by it, so all of the empty side's slots are masked);
only its packed rows are missing. When exactly one side was empty and the packed arrays have fewer rows
than the merged batch, zero rows are inserted along the batch axis where the empty side's rows belong (in
front for ``empty.extend(full)``, behind for ``full.extend(empty)``). Zero slots are covered by
``left_padding`` and are overwritten by the next update. When the arrays already have one row per batch
entry (the fixed upstream), nothing is changed. ``extend`` runs once per batch change, not per token.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _reproduce, _rows
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="batch-quantized-extend",
    summary="batch quantized extend() with one empty side keeps only the other side's packed rows",
    distribution="mlx-vlm",
    affected=">=0.5.0,<0.6.0",
    fixed_in="0.6.0",
    fixed_commit="654caf4c",
    introduced_commit="b0275383",
    reference="Blaizzy/mlx-vlm#1248",
    catalogue="V02",
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-vlm < 0.6.0 (and git pins before 654caf4c)",
        review_by=_dt.date(2027, 6, 1),
    ),
)


@PATCH.replace("mlx_vlm.models.cache", "BatchQuantizedKVCache.extend")
def _build(original: Any) -> Any:
    def extend(self: Any, other: Any) -> Any:
        self_empty = self.keys is None
        other_empty = other.keys is None
        n_self = self.offset.shape[0]
        n_other = other.offset.shape[0]
        result = original(self, other)
        if self_empty != other_empty and self.keys is not None:
            _rows.fill_missing_rows(self, self_empty, n_self, n_other)
        return result

    return extend


@PATCH.reproduce
def reproduce() -> Finding:
    """Merge a prefilled and an empty batch quantized cache (both orders), decode one token, and compare
    each row's attention output with the same row decoded in a cache of its own."""
    import mlx.core as mx

    try:
        from mlx_vlm.models.cache import BatchQuantizedKVCache
    except ImportError as exc:
        return _reproduce.absent(exc, "this mlx-vlm has no BatchQuantizedKVCache")

    mx.random.seed(0)
    H, D, T, group_size, bits = 2, 32, 5, 32, 4
    scale = D**-0.5
    prompt_k, prompt_v = mx.random.normal((1, H, T, D)), mx.random.normal((1, H, T, D))
    step_k, step_v = mx.random.normal((2, H, 1, D)), mx.random.normal((2, H, 1, D))
    queries = mx.random.normal((2, H, 1, D))

    def new_cache(prefilled: bool) -> Any:
        cache = BatchQuantizedKVCache([0], group_size=group_size, bits=bits)
        if prefilled:
            cache.update_and_fetch(prompt_k, prompt_v)
        return cache

    def attend(cache: Any, keys: Any, values: Any, q: Any) -> Any:
        qk, qv = cache.update_and_fetch(keys, values)
        k = mx.dequantize(*qk, group_size=group_size, bits=bits)
        v = mx.dequantize(*qv, group_size=group_size, bits=bits)
        mask = mx.arange(k.shape[-2])[None, None, None, :] >= cache.left_padding[:, None, None, None]
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    problems = []
    for order in ("full.extend(empty)", "empty.extend(full)"):
        full, empty = new_cache(True), new_cache(False)
        merged, other, p_full, p_empty = (full, empty, 0, 1) if order[0] == "f" else (empty, full, 1, 0)
        try:
            merged.extend(other)
            out = attend(merged, step_k, step_v, queries)
            mx.eval(out)
        except ValueError as exc:  # the bug's own error: the empty side's rows are missing from the join
            problems.append(f"{order}: decode raises ValueError: {symptom(exc, 'Cannot broadcast')}")
            continue
        # references: each row decoded alone, with the same step input and query as its batch row
        err = 0.0
        for prefilled, p in ((True, p_full), (False, p_empty)):
            ref = attend(new_cache(prefilled), step_k[p : p + 1], step_v[p : p + 1], queries[p : p + 1])
            err = max(err, mx.abs(out[p] - ref[0]).max().item())
        if err > 1e-4:
            problems.append(f"{order}: merged decode differs from per-row decode by {err:.3g}")
    if problems:
        return Finding(True, "; ".join(problems))
    return Finding(False, "both orders: merged decode equals per-row decode (max error <= 1e-4)")
