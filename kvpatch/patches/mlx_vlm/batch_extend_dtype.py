"""vlm-batch-extend-dtype (catalogue D2+F1, mlx-vlm's copy): an empty-side batch join turns bf16/fp16 to float32.

Broken: mlx-vlm's own ``mlx_vlm.models.cache.BatchKVCache.extend`` and ``BatchRotatingKVCache.extend`` (its
copies of mlx-lm's classes, from 0.6.4, commit a492e47d) give the side that has no keys yet (a row joining
with an empty cache, e.g. a one-token prompt that needs no prefill) zero-length placeholders built with
``mx.array([])``, which is float32; the concatenation then promotes the whole joined batch to float32.
Measured (Linux, mlx[cpu]) with a 2-row cache and an empty 1-row cache, ``full.extend(empty)`` and
``empty.extend(full)``, both classes: bfloat16 and float16 keys come back float32 (3 rows, right batch
size, right numbers) on every release of 0.6.4, 0.6.5, 0.6.13, 0.6.14, 0.6.16, 0.7.0, 0.7.6, 0.7.8 and
0.7.10. Twice the KV memory, and the row's next ``update_and_fetch`` writes into a float32 buffer, so a
request's numbers depend on whether another one joined its batch. It is the dtype half of mlx-lm's D2+F1
(ml-explore/mlx-lm#1491, fixed in mlx-lm 0.32.0), never carried over to mlx-vlm's copy; not reported to
mlx-vlm. mlx-vlm 0.6.3 and older re-export mlx-lm's classes (same bug with mlx-lm < 0.32.0), which the
mlx-lm patch ``batch-extend-empty`` fixes: out of this patch's range.

Fix: a delta in front of the original. When exactly one side has no keys, it gets zero-length keys and
values of its own row count with the other side's head count, head dims and dtype, instead of upstream's
float32 placeholders; the original then pads and joins exactly as before, so offsets, padding and
numbers are unchanged and only the dtype differs (the one a batch of that dtype should hold). ``other``
is a shallow copy before it gets them, so the caller's cache object is not modified; ``self`` is extended
in place as upstream does (and keeps ``keys=None`` if the original raises). Both sides empty, or both
full: the original runs untouched. ``extend`` runs once per batch join, not per token.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _rows
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="vlm-batch-extend-dtype",
    summary="mlx-vlm BatchKVCache/BatchRotatingKVCache.extend with an empty side turns a bf16/fp16 batch float32",
    distribution="mlx-vlm",
    affected=">=0.6.4,<=0.7.10",
    checked_through="0.7.10",
    introduced_commit="a492e47d",
    reference="not reported upstream",
    catalogue="D2+F1 (mlx-vlm's copy)",
    expiry=Expiry(
        "retire when mlx-vlm's own extend builds the empty side's placeholders in the other side's dtype",
        review_by=_dt.date(2027, 3, 1),
    ),
)


def _build(original: Any) -> Any:
    def extend(self: Any, other: Any) -> Any:
        if (self.keys is None) == (other.keys is None):
            return original(self, other)
        if self.keys is not None:
            return original(self, _rows.stand_in_empty_side(self, other))
        _rows.stand_in_empty_side(self, other)
        try:
            return original(self, other)
        except BaseException:
            if self.keys is not None and self.keys.shape[2] == 0:
                self.keys = self.values = None
            raise

    return extend


PATCH.replace("mlx_vlm.models.cache", "BatchKVCache.extend")(_build)
PATCH.replace("mlx_vlm.models.cache", "BatchRotatingKVCache.extend")(_build)


_NONE = "'NoneType' object"  # an empty side's keys are None (the bug's twin in older code)


@PATCH.reproduce
def reproduce() -> Finding:
    """Join a 2-row cache and an empty 1-row cache both ways, in bfloat16 and float16, with both classes.

    The joined cache must keep the input dtype, and after one more decoded token each row's attention output
    must equal that row's own attention (full rows: their 5 old keys plus the new one; the empty row: the new
    key only).
    """
    import mlx.core as mx
    from mlx_vlm.models import cache as C

    if not C.BatchKVCache.__module__.startswith("mlx_vlm."):
        return Finding(
            False,
            "mlx-vlm re-exports mlx-lm's BatchKVCache here",
            skipped="mlx-vlm < 0.6.4 has no batch caches of its own (mlx-lm's are covered by batch-extend-empty)",
        )
    mx.random.seed(0)
    H, D = 2, 8
    base = [mx.random.normal(shape) for shape in [(2, H, 5, D)] * 2 + [(3, H, 1, D)] * 3]

    def attend(q, keys, values, mask=None):
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=D**-0.5, mask=mask).astype(mx.float32)

    makers = [
        ("BatchKVCache", lambda n: C.BatchKVCache([0] * n)),
        ("BatchRotatingKVCache", lambda n: C.BatchRotatingKVCache(16, [0] * n)),
    ]
    problems, worst = [], 0.0
    for dtype in (mx.bfloat16, mx.float16):
        k, v, q_new, k_new, v_new = (a.astype(dtype) for a in base)
        for name, make in makers:
            for empty_first in (False, True):
                full, empty = make(2), make(1)
                full.update_and_fetch(k, v)
                a, b = (empty, full) if empty_first else (full, empty)
                label = f"{name} {dtype}: {'empty.extend(full)' if empty_first else 'full.extend(empty)'}"
                order = [2, 0, 1] if empty_first else [0, 1, 2]  # joined position -> source row (2: the empty one)
                try:
                    a.extend(b)
                    if a.keys.dtype != dtype or a.values.dtype != dtype:
                        problems.append(f"{label}: keys/values come back {a.keys.dtype}/{a.values.dtype}")
                    mask = a.make_mask(1, return_array=True)
                    src = mx.array(order)
                    keys, values = a.update_and_fetch(k_new[src], v_new[src])
                    out = attend(q_new[src], keys, values, mask)
                except AttributeError as exc:  # an empty side's keys are None (the bug's twin in older code)
                    problems.append(f"{label} raises AttributeError: {symptom(exc, _NONE)}")
                    continue
                errs = []
                for r in range(2):
                    kk = mx.concatenate([k[r : r + 1], k_new[r : r + 1]], axis=2)
                    vv = mx.concatenate([v[r : r + 1], v_new[r : r + 1]], axis=2)
                    errs.append(mx.abs(out[order.index(r)] - attend(q_new[r : r + 1], kk, vv)[0]).max().item())
                errs.append(mx.abs(out[order.index(2)] - attend(q_new[2:], k_new[2:], v_new[2:])[0]).max().item())
                worst = max(worst, *errs)
                if max(errs) > 1e-2:
                    problems.append(f"{label}: per-row attention error {max(errs):.3g} after the join")
    if problems:
        return Finding(True, "; ".join(problems))
    return Finding(
        False, f"bfloat16/float16 joins with an empty side keep their dtype; per-row attention error {worst:.2g}"
    )
