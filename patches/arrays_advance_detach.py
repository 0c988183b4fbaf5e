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
``ArraysCache`` (added: upstream's are plain instance attributes, and the stored value stays in the instance's
``__dict__`` under the same name). ``advance`` calls the original with both hidden (``None`` for the call, so it
does whatever else upstream's does) and adds ``N`` to a Python integer per attribute; reading the attribute
returns the stored array minus that total (one lazy subtraction, reused until the next ``advance``, and always
built on the stored array, never on an earlier read). Writers (``prepare``, ``filter``, ``extend``, ``merge``,
``state``, ``finalize``) store a new array and drop the total. A layer the model never reads builds no node; the
one it reads (its SSM mask) builds one subtraction per step, as upstream does. Values are identical (integer
arithmetic), nothing is evaluated, no host synchronisation; a non-integer ``N`` goes to the original untouched
(through the descriptors). Taking the patch out (``deactivate``, ``without``) writes every cache's total into
its attribute (``after_restore``: caches that advanced while it was in, and copies the garbage collector
knows of). Copies (``copy``/``deepcopy``, a server's prompt cache) carry the total with the array. Known limit:
a copy made and frozen by ``gc.freeze`` and never advanced or read before the patch is taken out keeps its
attribute short of the deferred total. mlx-vlm 0.6.16 fixed its own copy of this class the same way
(Blaizzy/mlx-vlm#1984); this patch keeps its two attributes' values exactly as upstream's would be.

Cost: nothing is tied or rebased while decoding (the nodes upstream frees when the caches are discarded are
freed then, as upstream does); see the README, "On Linux with an NVIDIA GPU".
"""

from __future__ import annotations

import datetime as _dt
import sys
from typing import Any

from kvpatch.patches import _arrays
from kvpatch.patches._lazy import graph_edges  # noqa: F401  (re-exported for the tests)

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


@PATCH.add("mlx_lm.models.cache", "ArraysCache.left_padding")
def _left_padding(_: Any) -> Any:
    return _arrays.deferred_metadata("left_padding")


@PATCH.add("mlx_lm.models.cache", "ArraysCache.lengths")
def _lengths(_: Any) -> Any:
    return _arrays.deferred_metadata("lengths")


@PATCH.replace("mlx_lm.models.cache", "ArraysCache.advance")
def _build(original: Any) -> Any:
    return _arrays.defer_advance(original)


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
