"""batch-filter-unprimed-vlm: mlx-vlm's own batch caches' ``filter`` before the first update drives ``_idx`` negative.

Broken: the bug of ``batch-filter-unprimed`` (mlx-lm's ``BatchKVCache``) in mlx-vlm's own classes:
``mlx_vlm.models.cache.BatchQuantizedKVCache.filter`` (0.5.0+) and mlx-vlm's own copy of ``BatchKVCache``
(0.6.4+) subtract ``min(left_padding)`` from ``_idx`` also when nothing has been written. Measured (Linux,
mlx[cpu], ``KVPATCH=off``; caches padded ``[0, 3]``, ``filter([1])``, then a 4-token update): both end with
``_idx=-3``, ``left_padding=[0]`` and the update raises ``ValueError: [broadcast_shapes] Shapes (1,2,4,64) and
(1,2,0,64)`` (quantized: ``(1,2,4,16) and (1,2,0,16)``) in 0.5.0, 0.6.3 (quantized class; there
``BatchKVCache`` is mlx-lm's), 0.6.4, 0.6.16 and 0.7.6; absent in 0.7.8 and 0.7.10 (0.7.7 was never
released), which cap the shift at ``_idx``, the same release and the same change that fixed the TurboQuant
twin (``tq-filter-unprimed``, V13), without a public commit. mlx-vlm's ``BatchRotatingKVCache`` copy does not
shift its padding in ``filter``: not affected.

How users meet it: mlx-vlm's server builds left-padded batch caches (``_make_cache(model, left_padding)``) for
each prompt batch and drops a request that is cancelled while its batch is being prefilled with ``filter``
(``PromptProcessingBatch.remove``); cancelled before its first prefill step, the next step raises and the
generation loop dies.

Where mlx-vlm re-exports mlx-lm's ``BatchKVCache`` (0.6.3 and older) that class is ``batch-filter-unprimed``'s
business: this patch leaves it as it is (``own_classes_only``).

Fix: the same delta as ``batch-filter-unprimed`` (``kvpatch/patches/_unprimed.py``): after the original, a negative
``_idx`` is set to 0 and the excess given back to ``left_padding``, the state mlx-vlm 0.7.8's capped shift
leaves. Nothing changes when ``_idx`` stays >= 0. No host sync (``_idx`` is a Python int); ``filter`` runs
when the batch changes, not per token.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _unprimed
from kvpatch.patches._numbers import judge, worst
from kvpatch.record import Expiry, Finding, Patch, own_class

PATCH = Patch(
    id="batch-filter-unprimed-vlm",
    summary="mlx-vlm batch caches' filter() before the first update drives _idx negative: the next update raises",
    distribution="mlx-vlm",
    affected=">=0.5.0,<0.7.8",
    fixed_in="0.7.8",
    catalogue="N1 (mlx-vlm's copies; twin of V13)",
    own_classes_only=True,
    reference="not reported upstream (fixed without a public commit in mlx-vlm 0.7.8; mlx-lm twin: "
    "ml-explore/mlx-lm#1736)",
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-vlm < 0.7.8",
        review_by=_dt.date(2027, 6, 1),
    ),
)


def own_batch_kv_cache() -> Any:
    """mlx-vlm's own BatchKVCache class (0.6.4+), or None where it re-exports mlx-lm's."""
    import mlx_vlm.models.cache as vlm_cache

    return own_class(vlm_cache, "BatchKVCache")


PATCH.replace("mlx_vlm.models.cache", "BatchQuantizedKVCache.filter")(_unprimed.cap_shift_at_written)


PATCH.replace("mlx_vlm.models.cache", "BatchKVCache.filter", optional=True)(_unprimed.cap_shift_at_written)


@PATCH.reproduce
def reproduce() -> Finding:
    """For each mlx-vlm batch class: filter an unprimed left-padded cache, then prefill and decode it; index,
    padding and each step's attention output must equal those of a cache created with the kept rows."""
    import mlx.core as mx
    from mlx_vlm.models.cache import BatchQuantizedKVCache

    H, D = 2, 64
    split = mx.random.split(mx.random.key(0), 2)
    k1, k2 = split[0], split[1]
    steps = [mx.random.normal((2, H, 5, D), key=k1), mx.random.normal((2, H, 1, D), key=k2)]
    classes: list[tuple[Any, Any]] = [
        (BatchQuantizedKVCache, lambda padding: BatchQuantizedKVCache(padding, group_size=32, bits=8))
    ]
    own = own_batch_kv_cache()
    if own is not None:
        classes.append((own, own))
    problems, found = [], []
    for cls, make in classes:
        wrong, measured = _unprimed.filtered_then_fresh(cls, make, steps)
        problems += wrong
        found += [measured] if measured is not None else []
    names = ", ".join(cls.__name__ for cls, _ in classes)
    return judge(
        worst(found),
        "prefill/decode attention differs from a fresh cache of the kept rows",
        f"{names}: unprimed filter keeps _idx=0 and the padding; prefill/decode equal a fresh cache",
        problems=problems,
    )
