"""churn-metadata-detach-vlm: mlx-vlm's own batch caches keep lazy metadata chains as rows come and go.

Broken: the bug of ``churn-metadata-detach`` in mlx-vlm's own copies (0.6.4+) of ``BatchKVCache`` and
``ArraysCache``: ``extend`` / ``filter`` rebuild ``offset`` (``BatchKVCache``) and ``left_padding`` / ``lengths``
(``ArraysCache``; from 0.6.16 stored behind upstream's properties) from the previous arrays, and nothing on the
decode path evaluates them; mlx-vlm's ``CacheList`` delegates to its children. Measured (Linux, mlx[cpu]; the
churn of ``_churn.churn_edges``: a 3-row batch, each cycle a one-row cache prefilled with 3 tokens joins, one decode
step with keys, values and states evaluated, the oldest row leaves), pending graph edges on the metadata after 10 /
200 / 500 / 1000 cycles, kvpatch off: ``BatchKVCache`` 190 / 3,610 / 9,010 / 18,010, ``ArraysCache`` 131 / 2,601 /
6,501 / 13,001, ``CacheList`` of both 320 / 6,210 / 15,510 / 31,010 on 0.6.4, 0.6.16 and 0.7.10; with kvpatch's
other fixes in place ``BatchKVCache`` 232 / 4,412 / 11,012 / 22,012 on 0.7.10 (offset-rebind-vlm's second handle
adds 4 edges per cycle to the same chain, measured). Not affected: ``BatchRotatingKVCache`` (ties its metadata into
the keys every step: 12 edges, flat), ``BatchQuantizedKVCache`` and ``BatchTurboQuantKVCache`` (18,010 after 1000 cycles
with kvpatch off, a flat 17 with ``offset-detach-vlm``, which ties the offset into every step's keys), and
``BatchPoolingCache`` (its metadata are Python lists). Before 0.6.4 ``mlx_vlm.models.cache`` re-exports mlx-lm's
classes: those are ``churn-metadata-detach``'s, and this patch leaves them alone (``own_classes_only``).

Upstream: not fixed as of 0.7.10; Blaizzy/mlx-vlm#1093 (closed unmerged) proposed evaluating the metadata every
decode step; the server-side fix is waybarrios/vllm-mlx#708 (``MLLMBatch._sync_reshuffle_metadata``).

Fix: the delta of ``churn-metadata-detach`` (``_churn.settle``): after the original ``extend`` / ``filter``, one
``mx.eval`` of the small metadata arrays the call left on the cache, once per request joining or leaving, never per
token (see ``_churn.settle`` for why an evaluation there is the cheap place). On 0.6.16+ the metadata is read
through upstream's properties, which after a writer return the stored array. Values are unchanged.
"""

from __future__ import annotations

import datetime as _dt

from kvpatch.patches import _churn
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="churn-metadata-detach-vlm",
    summary="mlx-vlm's own BatchKVCache/ArraysCache extend()/filter() rebuild metadata lazily: chains grow with churn",
    distribution="mlx-vlm",
    affected=">=0.6.4,<=0.7.10",
    checked_through="0.7.10",
    reference="Blaizzy/mlx-vlm#1093 (closed unmerged); server-side fix waybarrios/vllm-mlx#708 "
    "(mlx-lm twin: churn-metadata-detach)",
    catalogue="issue 29 item 1 (mlx-vlm's copies)",
    order=200,
    own_classes_only=True,
    expiry=Expiry(
        "retire when mlx-vlm's BatchKVCache and ArraysCache evaluate or tie the metadata extend()/filter() rebuild",
        review_by=_dt.date(2027, 3, 1),
    ),
)

CLASSES = ("BatchKVCache", "ArraysCache")


for _name in CLASSES:
    for _method in ("extend", "filter"):
        PATCH.replace("mlx_vlm.models.cache", f"{_name}.{_method}", optional=True)(_churn.settle)


@PATCH.reproduce
def reproduce() -> Finding:
    """mlx-vlm's own classes in a 3-row batch under membership churn: the metadata's graph (``_churn``)."""
    import mlx_vlm.models.cache as cache

    kinds = [name for name in CLASSES if _churn.vlm_own(name) is not None]
    if not kinds:
        return Finding(False, "this mlx-vlm re-exports mlx-lm's batch caches (churn-metadata-detach's)")
    if len(kinds) == len(CLASSES) and _churn.vlm_own("CacheList") is not None:
        kinds.append("CacheList")
    return _churn.churn_growth(cache, kinds)
