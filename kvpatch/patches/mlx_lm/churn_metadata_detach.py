"""churn-metadata-detach: a batch whose rows come and go (extend/filter) keeps lazy metadata chains for its lifetime.

Broken: a server's batch gains and loses rows as requests come and go. mlx-lm's ``BatchKVCache.extend`` /
``filter`` (0.28.0+) rebuild the per-row ``offset`` from the previous one (a concatenation, an index) and nothing
evaluates it: the decode mask reads the Python ``_idx``, ``filter``'s own ``tolist``/``item`` evaluates
``left_padding`` only, and the offset's per-step ``+ 1`` is evaluated only by layers that read it. From 0.31.3
``ArraysCache.extend`` / ``filter`` do the same to ``left_padding`` / ``lengths`` (0.31.2: ``lengths`` in
``filter``; before, both calls set ``left_padding`` to None), and only the one layer a model builds its SSM mask
from reads them. A ``CacheList`` (hybrid models) delegates to its children. Measured (Linux, mlx[cpu]; a 3-row
batch, each cycle a one-row cache prefilled with 3 tokens joins, one decode step with keys, values and states
evaluated, the oldest row leaves), pending graph edges on the metadata after 10 / 200 / 500 / 1000 cycles:
``BatchKVCache`` 190 / 3,610 / 9,010 / 18,010 on 0.28.0, 0.30.7, 0.31.3 and 0.32.2; ``ArraysCache`` 131 / 2,601 /
6,501 / 13,001 and ``CacheList(ArraysCache, BatchKVCache)`` 320 / 6,210 / 15,510 / 31,010 on 0.31.3 and 0.32.2;
the same with every other kvpatch fix in place (the decode-time ties bound a step's chain, not a membership change's).
On Metal each pending node holds a buffer: a server under steady traffic, whose batch never drains, ends at
``[metal::malloc] Resource limit (499000) exceeded``. ``BatchRotatingKVCache`` is not affected: its
``update_and_fetch`` ties ``offset`` and ``left_padding`` into the keys every step (0.31.1+, ml-explore/mlx-lm#960;
kvpatch's ``rotating-offset-detach`` before), which bounds the churn chain to 12-22 edges.

Upstream: not fixed as of 0.32.2. ml-explore/mlx-lm#1731 (closed unmerged) proposed guards for
``ArraysCache.filter``/``extend`` and ``BatchKVCache.update_and_fetch``; servers evaluate the metadata themselves
after their own filter/extend (waybarrios/vllm-mlx#708, ``MLLMBatch._sync_reshuffle_metadata``).

Fix: a delta after the original ``extend`` / ``filter`` of ``BatchKVCache`` and ``ArraysCache`` (``_churn.settle``):
one ``mx.eval`` of the metadata arrays the call left on the cache. Off the per-token path on purpose: these calls run
once per request joining or leaving, so an evaluation there costs one small host synchronisation per request (the
arrays hold a few integers per row and their graph holds only integer metadata, never keys, values or states), while
a tie on the decode path would cost every token. ``BatchKVCache.filter`` already synchronises on ``left_padding`` in
the same call. It composes with ``offset-detach`` (whose growth tie makes keys depend on the offset, never the
reverse: evaluating the offset evaluates no keys) and with ``arrays-advance-detach`` (after ``extend`` / ``filter``
have stored new ``left_padding`` / ``lengths``, reading them returns the stored arrays, which are evaluated), and it
installs outermost (``order``) so that the other fixes of ``filter`` have written their metadata first. Values are
unchanged.
"""

from __future__ import annotations

import datetime as _dt

from kvpatch.patches import _churn
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="churn-metadata-detach",
    summary="BatchKVCache/ArraysCache extend() and filter() rebuild per-row metadata lazily: chains grow with churn",
    distribution="mlx-lm",
    affected=">=0.28.0,<=0.32.2",
    checked_through="0.32.2",
    reference="ml-explore/mlx-lm#1731 (closed unmerged); server-side fix waybarrios/vllm-mlx#708",
    catalogue="issue 29 item 1",
    order=200,
    expiry=Expiry(
        "retire when mlx-lm's BatchKVCache and ArraysCache evaluate or tie the metadata extend()/filter() rebuild",
        review_by=_dt.date(2027, 3, 1),
    ),
)

for _name in ("BatchKVCache", "ArraysCache"):
    for _method in ("extend", "filter"):
        PATCH.replace("mlx_lm.models.cache", f"{_name}.{_method}")(_churn.settle)
# BatchRotatingKVCache (from mlx-lm 0.28.1) rebuilds the same metadata; its decode path ties it every step from
# 0.31.3, so what stays pending is a short chain, evaluated here all the same (a server's sweep evaluates it too)
for _method in ("extend", "filter"):
    PATCH.replace("mlx_lm.models.cache", f"BatchRotatingKVCache.{_method}", optional=True)(_churn.settle)


@PATCH.reproduce
def reproduce() -> Finding:
    """A 3-row batch under membership churn (join, decode one step, the oldest leaves): the metadata's graph."""
    import mlx_lm.models.cache as cache

    kinds = ["BatchKVCache"]
    if hasattr(cache.ArraysCache, "advance") and hasattr(cache.CacheList, "extend"):  # hybrid batches: 0.30.4+
        kinds += ["ArraysCache", "CacheList"]
    return _churn.churn_growth(cache, kinds)
