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

Upstream: partly fixed by 11a6ce75 (#1632), see above; not fixed as of 0.32.2.

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

from kvpatch.patches import _lazy
from kvpatch.patches._lazy import graph_edges

from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="arrays-advance-detach",
    summary="ArraysCache.advance decrements left_padding/lengths lazily and nothing evaluates them",
    distribution="mlx-lm",
    affected=">=0.30.4,<=0.32.2",
    checked_through="0.32.2",
    reference="ml-explore/mlx-lm#1632 (partial: bounded only where callers evaluate cache.state)",
    catalogue="B3",
    hot_path=True,
    expiry=Expiry(
        "retire when mlx-lm evaluates or ties ArraysCache metadata during decode (or clears it before decoding)",
        review_by=_dt.date(2027, 3, 1),
    ),
)


#: Per-cache count of ``advance`` calls since the last tie (an instance attribute: caches are plain objects).
_CALLS = "_kvpatch_advances"


@PATCH.replace("mlx_lm.models.cache", "ArraysCache.advance")
def _build(original: Any) -> Any:
    import mlx.core as mx

    tie = _lazy.tie(mx)
    every = _lazy.EVERY

    def advance(self: Any, N: Any) -> Any:
        result = original(self, N)
        state = self.__dict__
        calls = state.get(_CALLS, 0) + 1
        if calls < every:
            state[_CALLS] = calls
            return result
        state[_CALLS] = 0
        left_padding, lengths = self.left_padding, self.lengths
        if left_padding is None and lengths is None:
            return result
        deps = [a for a in (left_padding, lengths) if a is not None]
        entries = self.cache
        for i, entry in enumerate(entries):
            if entry is not None:
                entries[i] = tie(entry, deps)
                break
        return result

    return advance


@PATCH.reproduce
def reproduce() -> Finding:
    """A recurrent layer's cache: each step reads the old state, stores a new one, advances; only the
    states are evaluated (the layer's output depends on them, never on left_padding/lengths)."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache

    mx.random.seed(0)
    cache = ArraysCache(2, left_padding=[2, 0])
    cache.prepare(lengths=[3, 5])
    cache[0], cache[1] = mx.zeros((2, 3, 4)), mx.zeros((2, 4, 4))
    xs = mx.random.normal((200, 2, 1, 4))
    mx.eval(cache.cache, xs)
    edges = {}
    for i in range(200):
        cache[0] = mx.concatenate([cache[0][:, 1:], xs[i]], axis=1)
        cache[1] = cache[1] * 0.5 + cache[0].sum(axis=1, keepdims=True)
        cache.advance(1)
        mx.eval(cache[0], cache[1])
        if i + 1 in (20, 200):
            edges[i + 1] = (graph_edges(cache.left_padding), graph_edges(cache.lengths))
    values = (cache.left_padding.tolist(), cache.lengths.tolist())
    expected = ([2 - 200, 0 - 200], [3 - 200, 5 - 200])
    detail = f"left_padding/lengths graph edges after 20 steps: {edges[20]}, after 200: {edges[200]}"
    if values != expected:
        return Finding(True, f"{detail}; values {values}, expected {expected}")
    if edges[200][0] > edges[20][0] or edges[200][1] > edges[20][1]:
        return Finding(True, f"{detail} (unbounded)")
    return Finding(False, f"{detail} (bounded)")
