"""batch-extend-empty (catalogue D2+F1): extending a batch cache with (or into) an empty one breaks.

Broken: ``BatchKVCache.extend`` / ``BatchRotatingKVCache.extend`` join two batch caches (the running batch
and newly prefilled prompts). When one side has no keys yet (e.g. a batch of one-token prompts, which
need no prefill) it goes wrong in three release-dependent ways, measured with a 2-row bf16 cache and a
1-row empty one (``full.extend(empty)`` and ``empty.extend(full)``):

* 0.28.0–0.31.1: ``AttributeError: 'NoneType' object has no attribute 'shape'`` (both classes; both
  sides empty too);
* 0.31.2: keys of 4 rows for 3 rows of ``offset``/``left_padding`` (the empty side is padded with the
  other side's batch size), and the keys come back float32;
* 0.31.3: the right batch size, but a bf16 cache comes back float32 (twice the memory, and the next
  ``update_and_fetch`` writes bf16 into a float32 buffer).

Upstream: ml-explore/mlx-lm#1141 (62f38aeb, batch size, in 0.31.3) and ml-explore/mlx-lm#1491 (dtype), both
in 0.32.0 (measured clean on 0.32.0 and 0.32.2; 0.31.3 still has the dtype half). The dtype fix is not
on the public main line (its PR commit aaafac06 is unmerged there, and public main at 0.32.0 still lacks
it), so no ``fixed_commit`` is given: a git pin cannot be placed against it.
``BatchRotatingKVCache.extend`` first exists in 0.28.1 (optional target).

Fix: a delta in front of the original. An empty side gets zero-length keys and values shaped from the
other side: its own batch size (``offset`` has one entry per row), the other side's head count and head
dims and, crucially, its dtype. The original then left-pads it to the common length like any short
cache, so the result has every row, the caller's dtype and the empty rows fully left-padded (they see
only tokens that come after the join). ``other`` is copied before it gets stand-in keys, so the caller's
object is not modified; ``self`` is extended in place, as upstream does. Both sides empty: only
``offset`` and ``left_padding`` are joined (what 0.31.2+ do). Extend runs once per batch join.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _rows
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="batch-extend-empty",
    summary="BatchKVCache/BatchRotatingKVCache.extend with an empty side: crash, wrong batch size or bf16 -> float32",
    distribution="mlx-lm",
    affected=">=0.28.0,<0.32.0",
    fixed_in="0.32.0",
    reference="ml-explore/mlx-lm#1141",
    catalogue="D2+F1",
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-lm < 0.32.0",
        review_by=_dt.date(2027, 6, 1),
    ),
)


def _build(original: Any) -> Any:
    import mlx.core as mx

    def extend(self: Any, other: Any) -> Any:
        if self.keys is None and other.keys is None:
            self.offset = mx.concatenate([self.offset, other.offset])
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            return None
        return original(self, _rows.stand_in_empty_side(self, other))

    return extend


PATCH.replace("mlx_lm.models.cache", "BatchKVCache.extend")(_build)
PATCH.replace("mlx_lm.models.cache", "BatchRotatingKVCache.extend", optional=True)(_build)


_NONE = "'NoneType' object has no attribute"  # the bug's own error: the empty side's keys are None


@PATCH.reproduce
def reproduce() -> Finding:
    """Join a 2-row bf16 cache and an empty 1-row cache both ways; check rows, dtype and attention numbers.

    After the join every row decodes one more token; each row's attention output must equal that row's
    own attention (the full rows over their 5 old keys plus the new one, the empty row over the new key
    only), and keys must stay bfloat16.
    """
    import mlx.core as mx
    from mlx_lm.models import cache as C

    mx.random.seed(0)
    H, D = 2, 8
    k = mx.random.normal((2, H, 5, D)).astype(mx.bfloat16)
    v = mx.random.normal((2, H, 5, D)).astype(mx.bfloat16)
    q_new = mx.random.normal((3, H, 1, D)).astype(mx.bfloat16)
    k_new = mx.random.normal((3, H, 1, D)).astype(mx.bfloat16)
    v_new = mx.random.normal((3, H, 1, D)).astype(mx.bfloat16)

    def attend(q, keys, values, mask=None):
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=D**-0.5, mask=mask).astype(mx.float32)

    classes = [("BatchKVCache", lambda: C.BatchKVCache([0]), lambda: C.BatchKVCache([0, 0]))]
    if hasattr(getattr(C, "BatchRotatingKVCache", None), "extend"):
        classes.append(
            (
                "BatchRotatingKVCache",
                lambda: C.BatchRotatingKVCache(16, [0]),
                lambda: C.BatchRotatingKVCache(16, [0, 0]),
            )
        )
    problems = []
    for name, make_one, make_two in classes:
        for empty_first in (False, True):
            full, empty = make_two(), make_one()
            full.update_and_fetch(k, v)
            a, b = (empty, full) if empty_first else (full, empty)
            label = f"{name}: {'empty.extend(full)' if empty_first else 'full.extend(empty)'}"
            try:
                a.extend(b)
                # joined order of the source rows (full row 0, full row 1, empty row = 0, 1, 2)
                order = [2, 0, 1] if empty_first else [0, 1, 2]
                if a.keys.dtype != mx.bfloat16:
                    problems.append(f"{label}: keys come back {a.keys.dtype}, not bfloat16")
                sizes = (a.keys.shape[0], a.offset.shape[0], a.left_padding.shape[0])
                if sizes != (3, 3, 3):
                    problems.append(f"{label}: rows of (keys, offset, left_padding) = {sizes}, expected 3 each")
                    continue
                mask = a.make_mask(1, return_array=True)
                src = mx.array(order)
                keys, values = a.update_and_fetch(k_new[src], v_new[src])
                out = attend(q_new[src], keys, values, mask)
            except AttributeError as exc:  # the bug's own error: the empty side's keys are None
                problems.append(f"{label} raises AttributeError: {symptom(exc, _NONE)}")
                continue
            errs = []
            for r in range(2):
                kk = mx.concatenate([k[r : r + 1], k_new[r : r + 1]], axis=2)
                vv = mx.concatenate([v[r : r + 1], v_new[r : r + 1]], axis=2)
                errs.append(mx.abs(out[order.index(r)] - attend(q_new[r : r + 1], kk, vv)[0]).max().item())
            errs.append(mx.abs(out[order.index(2)] - attend(q_new[2:], k_new[2:], v_new[2:])[0]).max().item())
            if max(errs) > 1e-2:
                problems.append(f"{label}: per-row attention error {max(errs):.3g} after the join")
    if problems:
        return Finding(True, "; ".join(problems))
    return Finding(False, "joins with an empty side keep every row, stay bfloat16 and attend like each row alone")
