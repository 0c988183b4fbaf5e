"""batch-filter-unprimed: mlx-lm's ``BatchKVCache.filter`` before the first update drives ``_idx`` negative.

Broken: ``mlx_lm.models.cache.BatchKVCache.filter`` drops the leading padding every kept row shares by
subtracting ``min(left_padding)`` from the write index ``_idx`` (and from ``left_padding``), also when fewer
slots than that have been written. A left-padded cache filtered before its first update (a request cancelled
before its first prefill step): ``BatchKVCache([0, 3])``, ``filter([1])`` leaves ``_idx=-3``,
``left_padding=[0]``, ``offset=[-3]``; the next update of 4 tokens writes to slots ``-3:1`` and raises
``ValueError: [broadcast_shapes] Shapes (1,2,4,64) and (1,2,0,64) cannot be broadcast`` (mlx-lm#1736 saw it
in attention instead: a mask built from the negative index is ``(1,1,1,0)``). Had it not raised, the kept
row's 3 padding slots would no longer be masked. ``BatchRotatingKVCache.filter`` does not shift the
padding: not affected (measured: it ends equal to a fresh ``BatchRotatingKVCache(16, [3])``).

Measured (Linux, mlx[cpu], ``KVPATCH=off``): present in 0.31.2, 0.31.3 (through mlx-vlm 0.5.0-0.6.3, which
re-export it), 0.32.0 and 0.32.2. In 0.28.0-0.31.1 ``filter`` indexes ``keys`` unconditionally: on a cache
that was never updated both batch classes raise ``TypeError: 'NoneType' object is not subscriptable`` at the
``filter`` call (another symptom, not patched: mlx-lm's own generators never filter an unprimed cache, and
every mlx-vlm release with batch caches needs mlx-lm >= 0.31.3). The guard that let ``filter`` through
(``if self.keys is not None``) came with 3f9d179f (ml-explore/mlx-lm#1072), first released in 0.31.2.
Not fixed upstream as of 0.32.2; ml-explore/mlx-lm#1736 (closed, not merged) proposed the fix. mlx-vlm's own
copies (0.6.4+) and its ``BatchQuantizedKVCache`` have the same bug until 0.7.7 (patch
``batch-filter-unprimed-vlm``); the TurboQuant twin is ``tq-filter-unprimed``.

How users meet it: mlx-lm's ``BatchGenerator`` prefills a prompt batch in the same step it builds it (and
merges prompt caches with no left padding when all are empty), so not through it; mlx-vlm 0.5.0-0.6.3 build
left-padded ``BatchKVCache``s with ``_make_cache(model, left_padding)`` and drop a cancelled request with
``filter`` (``PromptProcessingBatch.remove``), and so do servers that drive the cache API themselves.

Fix: a delta after the original (``kvpatch/patches/_unprimed.py``). If ``_idx`` ended below 0, the excess is given
back: ``_idx`` becomes 0 and ``left_padding`` is raised by the excess, which is the state of a cache created
with the kept rows (mlx-vlm 0.7.8 fixed its copies the same way, capping the shift at ``_idx``). Nothing
changes when ``_idx`` stays >= 0. ``_idx`` is a Python int: no host sync. ``filter`` runs when the batch
changes, not per token.
"""

from __future__ import annotations

import datetime as _dt

from kvpatch.patches import _unprimed
from kvpatch.patches._numbers import judge
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="batch-filter-unprimed",
    summary="BatchKVCache.filter() before the first update drives _idx negative: the next update raises",
    distribution="mlx-lm",
    affected=">=0.31.2,<=0.32.2",
    introduced_commit="3f9d179f",
    checked_through="0.32.2",
    catalogue="N1 (issue 12 item 1)",
    reference="ml-explore/mlx-lm#1736 (closed unmerged; its second part)",
    expiry=Expiry(
        "retire when mlx-lm's BatchKVCache.filter caps the padding shift at _idx (set fixed_in then) and "
        "kvpatch stops supporting the releases before",
        review_by=_dt.date(2027, 3, 1),
    ),
)

PATCH.replace("mlx_lm.models.cache", "BatchKVCache.filter")(_unprimed.cap_shift_at_written)


@PATCH.reproduce
def reproduce() -> Finding:
    """Filter an unprimed left-padded ``BatchKVCache``, then prefill and decode it: index, padding and each
    step's attention output must equal those of a cache created with the kept rows."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    H, D = 2, 32
    split = mx.random.split(mx.random.key(0), 2)
    k1, k2 = split[0], split[1]
    keys = [mx.random.normal((2, H, 5, D), key=k1), mx.random.normal((2, H, 1, D), key=k2)]
    problems, found = _unprimed.filtered_then_fresh(BatchKVCache, BatchKVCache, keys)
    return judge(
        found,
        "prefill/decode attention differs from a fresh cache of the kept rows",
        "unprimed filter keeps _idx=0 and the rows' padding; prefill and decode equal a fresh cache",
        problems=problems,
    )
