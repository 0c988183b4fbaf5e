"""tq-filter-unprimed (catalogue V13): filtering a left-padded batch TurboQuant cache before its first update.

Broken: in mlx-vlm 0.5.0–0.7.6 ``mlx_vlm.turboquant.BatchTurboQuantKVCache.filter`` drops the leading
padding every kept row shares by subtracting ``min(left_padding)`` from the write index ``_idx`` (and
from ``left_padding``), also when fewer slots than that have been written. A cache filtered before its
first update (rows ``[3, 0, 2]``, keep rows 0 and 2) ends with ``_idx=-2`` and ``left_padding=[1, 0]``:
the next update writes its 5 tokens at slot -2 and raises ``ValueError: [broadcast_shapes] Shapes
(2,2,5) and (2,2,2) cannot be broadcast`` (the catalogue's ``_idx=-3``/``(1,2,4) into (1,2,1)`` is the
same bug with other sizes); had it not raised, the kept rows' padding would no longer be masked.

Measured (Linux, mlx[cpu]): present in 0.5.0, 0.6.3, 0.6.15 and 0.7.6; absent in 0.7.8 and 0.7.10 (0.7.7
was never released). The batch class first appears in 0.5.0 (git b0275383, #1030). Fixed upstream in
0.7.8, which caps the amount at ``_idx``; that change has no public commit.

Fix: a delta after the original. If the original moved ``_idx`` below 0, it dropped more leading slots
than had been written: the excess is given back, ``_idx`` becomes 0 and ``left_padding`` is raised by
the excess, which is the state a cap at ``_idx`` gives (nothing written, every row keeps its padding).
When ``_idx`` stays >= 0 (every primed cache with consistent padding) nothing is changed. From 0.7.0
the host-side fused-kernel guard is refreshed afterwards, as the original does. ``filter`` runs once per
batch change, not per token.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _reproduce, _unprimed
from kvpatch.patches._numbers import difference, judge, worst
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="tq-filter-unprimed",
    summary="batch TurboQuant filter() before the first update drives _idx negative: next update raises",
    distribution="mlx-vlm",
    affected=">=0.5.0,<0.7.8",
    fixed_in="0.7.8",
    introduced_commit="b0275383",
    reference="not reported upstream (fixed without a public commit in mlx-vlm 0.7.8)",
    catalogue="V13",
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-vlm < 0.7.8",
        review_by=_dt.date(2027, 6, 1),
    ),
)


@PATCH.replace("mlx_vlm.turboquant", "BatchTurboQuantKVCache.filter")
def _build(original: Any) -> Any:
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    refresh = getattr(BatchTurboQuantKVCache, "_refresh_fused_attention_eligibility", None)  # 0.7.0+

    return _unprimed.cap_shift_at_written(original, refresh)


@PATCH.reproduce
def reproduce() -> Finding:
    """Filter an unprimed left-padded batch cache, then prefill and decode it: write index, padding and
    each step's attention output must equal those of a cache created with the kept rows."""
    import mlx.core as mx

    try:
        from mlx_vlm.turboquant import BatchTurboQuantKVCache
    except ImportError as exc:
        return _reproduce.absent(exc, "this mlx-vlm has no BatchTurboQuantKVCache")

    mx.random.seed(0)
    H, D, T, bits = 2, 32, 5, 4
    steps = [(mx.random.normal((2, H, n, D)), mx.random.normal((2, H, n, D))) for n in (T, 1)]
    q = mx.random.normal((2, H, 1, D))

    def attend(cache: Any, keys: Any, values: Any) -> Any:
        ks, vs = cache.update_and_fetch(keys, values)
        k, v = cache.dequantize(ks, vs)
        return _reproduce.left_padded_attention(q, k, v, cache.left_padding, D**-0.5)

    filtered = BatchTurboQuantKVCache([3, 0, 2], bits=bits)
    filtered.filter(mx.array([0, 2]))
    fresh = BatchTurboQuantKVCache([3, 2], bits=bits)
    state = f"_idx={filtered._idx}, left_padding={filtered.left_padding.tolist()}"
    problems = []
    if filtered._idx != 0 or filtered.left_padding.tolist() != [3, 2]:
        problems.append(f"after filter: {state} (expected _idx=0, left_padding=[3, 2])")
    found = []
    try:
        for i, (keys, values) in enumerate(steps):
            out, ref = attend(filtered, keys, values), attend(fresh, keys, values)
            found.append(difference(out, ref, where=f"{'prefill' if i == 0 else 'decode'} attention"))
    except ValueError as exc:  # the bug's own error: the negative _idx misaligns the next update
        problems.append(f"next update raises ValueError: {symptom(exc, '[broadcast_shapes]')}")
    return judge(
        worst(found),
        "prefill/decode differ from a fresh cache of the kept rows",
        "unprimed filter keeps _idx=0 and the padding; prefill and decode equal a fresh cache",
        problems=problems,
    )
