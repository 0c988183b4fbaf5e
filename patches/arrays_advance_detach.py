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

Fix: a delta after the original (``_arrays.rebase_advance``). kvpatch keeps, per cache and attribute, an anchor
(its own handle on the value when it first saw it, evaluated since) and the Python sum of the ``N`` advanced
after it. Every 10th ``advance`` of a cache (``_lazy.EVERY``), each of ``left_padding``/``lengths`` that is set
is rebased: its pending chain of decrements is dropped unevaluated and replaced with one lazy subtraction,
``anchor - total``. At most 10 steps' decrements are ever pending, and in steady decoding nothing is evaluated
and nothing joins the model's graph. Anchoring (a new cache, or metadata another method replaced) ties the
anchor into the first stored state entry (``mx.depends``), so the layer's next step evaluates it once. Cost,
measured on an H100 with ``scripts/bench_gpu.py`` (1.1B LFM2-style hybrid, bf16, BatchGenerator, this patch
alone toggled, batch 1, 2026-11-26): 0.978 [0.974, 0.982] of the unpatched speed (median of 472 pairs), decode
steps only. What is known of it: the patch frees the dropped chains during decoding, which upstream does only
when the caches are discarded (``scripts/probe_advance_cost.py`` on H100 hosts, 11 caches: +230-390 us at each
rebasing step, +25-38 us per step on average; discarding them after 500 steps took upstream 27-32 ms and the
patched 0.7 ms); a further ~30 us per step is not established. Whole generations with the discarding clocked
(``bench_gpu.py --teardown``, all hot-path patches, batch 1): 1.026 [1.002, 1.051], 40 pairs. The figures of
0.92-0.95 measured before (with this version and the one before it, which evaluated one subtraction per
attribute every 10th step) charged the patch with evaluating the chain the benchmark's unpatched block had
left: its timed block began at the step that evaluates the anchor. The rebase is exact only if every decrement
went through the replacement: it is done only when the attribute still holds the array kvpatch put there (every
other writer in 0.30.4-0.32.2 assigns a new array), the book was written by this installation of the patch
(decrements made while it was taken out are not lost) and every ``N`` was a Python int; otherwise kvpatch
re-anchors. Stored values are unchanged; no host synchronisation. When both are ``None`` (single-sequence
generation, mlx-lm <= 0.31.2 BatchGenerator after ``finalize``) nothing is done. On mlx without ``mx.depends``
(0.29.0/0.29.1, below what mlx-lm 0.30.4 requires) the anchor is multiplied into the entry by an exact 1
instead.
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
    return _arrays.rebase_advance(original)


@PATCH.reproduce
def reproduce() -> Finding:
    """A recurrent layer's cache advanced 200 steps with only its states evaluated (see ``_arrays``)."""
    from mlx_lm.models.cache import ArraysCache

    return _arrays.advance_growth(ArraysCache)
