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

Fix: a delta after the original: every 10th ``advance`` of a cache (``_lazy.EVERY``; the count lives on
the cache object as ``_kvpatch_advances``), once it has decremented the metadata, the first stored state
entry is made to depend on it (``mx.depends``), so the layer's next step, which reads that state,
evaluates the metadata too; at most 10 steps' decrements are ever pending (<= 60 graph edges), and the
tie's graph node is built once per 10 calls (the others cost a dictionary read and write). ``mx.depends``
shares the entry's buffer (no copy, no arithmetic, no host synchronisation) and the stored values
are unchanged. When both are ``None`` (single-sequence generation, mlx-lm <= 0.31.2 BatchGenerator
after ``finalize``) nothing is tied. On mlx without ``mx.depends`` (0.29.0/0.29.1, below what
mlx-lm 0.30.4 requires) the entry is multiplied by an exact 1 derived from the metadata instead.
"""

from __future__ import annotations

import datetime as _dt
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


@PATCH.replace("mlx_lm.models.cache", "ArraysCache.advance")
def _build(original: Any) -> Any:
    return _arrays.tie_advance(original)


@PATCH.reproduce
def reproduce() -> Finding:
    """A recurrent layer's cache advanced 200 steps with only its states evaluated (see ``_arrays``)."""
    from mlx_lm.models.cache import ArraysCache

    return _arrays.advance_growth(ArraysCache)
