"""arrays-advance-detach (catalogue B3): ArraysCache.advance grows lazy left_padding/lengths graphs.

Broken: in mlx-lm 0.30.4–0.32.2 ``mlx_lm.models.cache.ArraysCache.advance(N)`` (called by every SSM /
linear-attention / conv layer of hybrid models: Qwen3-Next, Qwen3.5, LFM2, Mamba2, Nemotron-H, ...
after it stores its new state) decrements ``left_padding`` and ``lengths`` lazily and nothing
evaluates them: only the one cache a model builds its SSM mask from reads ``left_padding``, so in every
other such layer the chains grow by 5 graph edges per decoded token without bound.

Measured (tiny random LFM2, 3 conv layers, 200 decode tokens, outputs evaluated every step):

* mlx-lm's own BatchGenerator (4 rows): on 0.31.3, 0.32.0 and 0.32.2 ``ArraysCache.merge`` gives
  fresh caches ``left_padding = zeros(B)`` and nothing clears it before decoding: two of the three
  layers end at 972–1022 edges. On 0.30.4–0.31.2 ``finalize()`` set both to ``None`` before decoding
  (no growth there).
* any decode loop that keeps a left-padded ArraysCache (servers driving the model): 1005 edges per
  layer after 200 steps on every release 0.30.4–0.32.2.
* upstream 11a6ce75 (ml-explore/mlx-lm#1632, in 0.32.0) put ``left_padding``/``lengths`` into
  ``state``: callers that evaluate ``state`` each step are bounded from 0.32.0 (0 edges), but no mlx-lm
  generator does during decode, so the bug stays for them.

0.30.2 and older have no ``advance`` (out of range).

Upstream: partly fixed by 11a6ce75 (#1632), see above; not fixed as of 0.32.2. ml-explore/mlx-lm#1731
(closed unmerged) guarded ``ArraysCache.filter``/``extend`` metadata but not ``advance``; ml-explore/mlx-lm#1845
(open) reports this ``advance`` leak through ``BatchGenerator`` after #1632.

Fix: upstream's chains are never built (``_arrays``). ``left_padding`` and ``lengths`` become data descriptors on
``ArraysCache`` (added: upstream's are plain instance attributes, and the stored array stays in the instance's
``__dict__`` under the same name). ``advance`` makes upstream's two decrements as Python integers: one store each of
``(stored array, total)`` in a kvpatch key beside the attribute. A read returns the stored array minus that total,
computed afresh (one lazy subtraction over the stored array) and stored nowhere, as mlx-vlm 0.6.16's own class
reads its metadata: a read is pure, so a thread that reads a cache never leaves an array of its own stream in it,
and a reader never sees the attribute ``None`` or missing during ``advance``. Writers (``prepare``, ``filter``,
``extend``, ``merge``, ``state``, ``finalize``) store a new array and drop the total. A layer the model never reads
builds no node; the one it reads (its SSM mask) builds one subtraction per read. Values are identical (integer
arithmetic), nothing is evaluated, no host synchronisation; a non-integer ``N`` goes to the original untouched
(through the descriptors). Pickles and copies (``__reduce_ex__``, which upstream's class inherits from ``object``:
it pickles and copies through its ``__dict__``) carry upstream's values only, with no kvpatch key, so a pickle
loads right where kvpatch is absent or the patch is off. Taking the patch out (``deactivate``, ``without``) writes
every cache's total into its attribute (``after_restore``: caches that advanced while it was in, and instances
the garbage collector knows of). Known limit: an instance whose ``__dict__`` was copied by hand and that is frozen
by ``gc.freeze`` before the patch is taken out keeps its attribute short of the deferred total.

Where this differs from upstream's in-place ``-=`` (mx.array's ``__isub__`` changes the stored array itself):
``vars(cache)['left_padding']`` is the stored array without the pending decrements (plus a ``_kvpatch_pending_*``
key while some are pending); an array read before an ``advance``, and a ``copy.copy``'s attribute, keep their value
instead of moving with the cache; an in-place edit of a read array (``lp[0] = 100``) reaches the cache only where no
decrement is pending (the read then returns the stored array itself, as upstream's does); each read after an
``advance`` is a new array (one lazy subtraction from the stored one, so evaluating ``cache.state`` does not leave
the attribute evaluated: mlx-lm 0.32's own ``test_arrays_cache_advance`` counts that one graph edge).
mlx-vlm 0.6.16+ behaves the same way in each of these (its ``vars`` hold
``_left_padding`` and ``_left_padding_advance``). It cannot be otherwise: a stored array that moves on ``advance`` is
upstream's chain. No mlx-lm or mlx-vlm code in this patch's range (or vlm-arrays-advance-detach's) reads a cache's
``__dict__``, edits its metadata in place, holds it across an ``advance``, or copies a cache with ``copy.copy``.

Cost: nothing is tied or rebased while decoding (the nodes upstream frees when the caches are discarded are
freed then, as upstream does); see docs/performance.md.
"""

from __future__ import annotations

import datetime as _dt
import sys
from typing import Any

from kvpatch.patches import _arrays
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="arrays-advance-detach",
    summary="ArraysCache.advance decrements left_padding/lengths lazily and nothing evaluates them",
    distribution="mlx-lm",
    affected=">=0.30.4,<=0.32.2",
    checked_through="0.32.2",
    reference="ml-explore/mlx-lm#1632 (partial: bounded only where callers evaluate cache.state); "
    "ml-explore/mlx-lm#1731 (closed unmerged), ml-explore/mlx-lm#1845 (open)",
    catalogue="B3",
    hot_path=True,
    expiry=Expiry(
        "retire when mlx-lm evaluates or ties ArraysCache metadata during decode (or clears it before decoding)",
        review_by=_dt.date(2027, 3, 1),
    ),
)


_arrays.declare_deferred(PATCH, "mlx_lm.models.cache")


@PATCH.replace("mlx_lm.models.cache", "ArraysCache.__reduce_ex__", optional=True)
def _pickle(original: Any) -> Any:
    # optional: upstream's class inherits object's, which has no source to fingerprint
    return _arrays.pickle_upstream_values(original)


@PATCH.after_restore
def _flush() -> None:
    """The descriptors are gone: each cache's attribute must hold its value again, deferred decrements included."""
    module = sys.modules.get("mlx_lm.models.cache")
    cls = getattr(module, "ArraysCache", None)
    if isinstance(cls, type):
        _arrays.flush(cls)


@PATCH.reproduce
def reproduce() -> Finding:
    """A recurrent layer's cache advanced 200 steps with only its states evaluated (see ``_arrays``)."""
    from mlx_lm.models.cache import ArraysCache

    return _arrays.advance_growth(ArraysCache)
