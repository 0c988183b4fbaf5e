"""empty-tq-rows (catalogue V03): batch TurboQuant ``extend`` drops the rows of the side with no keys yet.

Broken: ``mlx_vlm.turboquant.BatchTurboQuantKVCache.extend`` has a shortcut for "one side has no keys
yet" that keeps only the other side's packed key/value rows, while ``offset`` and ``left_padding`` are
concatenated for both sides. The cache then holds B=1 packed rows for a batch of 2, and the next decode
step raises ``ValueError: Cannot broadcast array of shape (2,2,1) into shape (1,2,1)`` when it writes the
new token. Both orders fail: ``full.extend(empty)`` and ``empty.extend(full)``. In ``empty.extend(full)``
the merged cache also keeps no codec of its own (it builds a fresh one on the next update) although its
packed rows were encoded by the other side's codec.

Measured (Linux, mlx[cpu]): present in mlx-vlm 0.5.0, 0.6.0, 0.6.4, 0.7.8 and 0.7.10 (the class first
appears in 0.5.0, git b0275383 / #1030; 0.4.4 has no BatchTurboQuantKVCache). Not fixed upstream as of
0.7.10; not reported upstream. The uniform quantized twin (V02, ``batch-quantized-extend``) was fixed in
0.6.0 by Blaizzy/mlx-vlm#1248.

Fix: a delta after the original. The original's bookkeeping is right (``_idx`` becomes the longer
side's length, the empty side's ``left_padding`` is raised by it, so all of the empty side's slots are
masked); only its packed rows are missing. When exactly one side was empty and the packed state has
fewer rows than the merged batch, zero rows are inserted along the batch axis where the empty side's
rows belong (in front for ``empty.extend(full)``, behind for ``full.extend(empty)``), in every array of
the (possibly nested) state; and a cache that had no codec adopts the codec that encoded the rows it now
holds. Zero slots are covered by ``left_padding`` and are overwritten by the next update. When the
state already has one row per batch entry (a fixed upstream), nothing is changed. ``extend`` runs once
per batch change, not per token.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _reproduce, _rows
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="empty-tq-rows",
    summary="batch TurboQuant extend() with one empty side keeps only the other side's packed rows",
    distribution="mlx-vlm",
    affected=">=0.5.0,<=0.7.10",
    introduced_commit="b0275383",
    checked_through="0.7.10",
    reference="not reported upstream",
    catalogue="V03",
    expiry=Expiry(
        "retire when mlx-vlm's BatchTurboQuantKVCache.extend keeps one packed row per batch entry "
        "when one side is empty (the reproduction then finds the bug absent)",
        review_by=_dt.date(2027, 3, 1),
    ),
)


@PATCH.replace("mlx_vlm.turboquant", "BatchTurboQuantKVCache.extend")
def _build(original: Any) -> Any:
    def extend(self: Any, other: Any) -> Any:
        self_empty = self.keys is None
        other_empty = other.keys is None
        n_self = self.offset.shape[0]
        n_other = other.offset.shape[0]
        result = original(self, other)
        if self_empty != other_empty and self.keys is not None:
            _rows.fill_missing_rows(self, self_empty, n_self, n_other)
            if self_empty and self.key_codec is None:
                self.key_codec = other.key_codec
                self.value_codec = other.value_codec
        return result

    return extend


@PATCH.reproduce
def reproduce() -> Finding:
    """Merge a prefilled and an empty batch TurboQuant cache (both orders), decode one token, and compare
    each row's attention output with the same row decoded in a cache of its own."""
    import mlx.core as mx

    try:
        from mlx_vlm.turboquant import BatchTurboQuantKVCache
    except ImportError as exc:
        return _reproduce.absent(exc, "this mlx-vlm has no BatchTurboQuantKVCache")

    mx.random.seed(0)
    H, D, T, bits = 2, 32, 5, 4
    scale = D**-0.5
    prompt_k, prompt_v = mx.random.normal((1, H, T, D)), mx.random.normal((1, H, T, D))
    step_k, step_v = mx.random.normal((2, H, 1, D)), mx.random.normal((2, H, 1, D))
    queries = mx.random.normal((2, H, 1, D))

    def attend(cache: Any, keys: Any, values: Any, q: Any, left_padding: Any) -> Any:
        ks, vs = cache.update_and_fetch(keys, values)
        k, v = cache.dequantize(ks, vs)
        mask = mx.arange(k.shape[-2])[None, None, None, :] >= left_padding[:, None, None, None]
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    def full_cache() -> Any:
        cache = BatchTurboQuantKVCache([0], bits=bits)
        cache.update_and_fetch(prompt_k, prompt_v)
        return cache

    problems = []
    for order in ("full.extend(empty)", "empty.extend(full)"):
        full, empty = full_cache(), BatchTurboQuantKVCache([0], bits=bits)
        merged, other, p_full, p_empty = (full, empty, 0, 1) if order[0] == "f" else (empty, full, 1, 0)
        try:
            merged.extend(other)
            out = attend(merged, step_k, step_v, queries, merged.left_padding)
            mx.eval(out)
        except ValueError as exc:  # the bug's own error: the empty side's rows are missing from the join
            problems.append(f"{order}: decode raises ValueError: {symptom(exc, 'Cannot broadcast')}")
            continue
        # references: each row decoded alone, with the same step input and query as its batch row
        alone = [full_cache(), BatchTurboQuantKVCache([0], bits=bits)]
        err = 0.0
        for cache, p in zip(alone, (p_full, p_empty), strict=True):
            ref = attend(cache, step_k[p : p + 1], step_v[p : p + 1], queries[p : p + 1], mx.array([0]))
            err = max(err, mx.abs(out[p] - ref[0]).max().item())
        if err > 1e-4:
            problems.append(f"{order}: merged decode differs from per-row decode by {err:.3g}")
    if problems:
        return Finding(True, "; ".join(problems))
    return Finding(False, "both orders: merged decode equals per-row decode (max error <= 1e-4)")
