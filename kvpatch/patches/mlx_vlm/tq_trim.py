"""tq-trim (catalogue V05+V06): the batch TurboQuant cache cannot be rolled back.

Broken: in mlx-vlm 0.5.0–0.6.3 ``mlx_vlm.turboquant.BatchTurboQuantKVCache.is_trimmable()`` returns
False and ``trim(n)`` returns 0 without touching the cache, so a speculative / multi-token (MTP) rollback
keeps the rejected tokens: after a 6-token left-padded prompt, 3 draft tokens and ``trim(3)`` the next
decode attends over 10 slots instead of 7 and its attention output differs from a cache that never saw
the drafts (max error 0.874 in the reproduction). Neither TurboQuant cache has ``zero_row_tail`` (the
rollback hook the model rollbacks of 0.6.4+ and downstream servers call: AttributeError), and Gemma 4's
own ``rollback_speculative_cache`` zeroes rejected row tails with ``cache.keys[bi, :, a:b] = 0``, which
raises ``TypeError: 'TurboQuantMSEState' object does not support item assignment`` on a TurboQuant
state whenever batch rows accept different numbers of drafts.

Measured (Linux, mlx[cpu], mlx-lm 0.31.3): present in mlx-vlm 0.5.0 and 0.6.3; absent in 0.6.4, 0.6.13,
0.7.6 and 0.7.10. The batch class first appears in 0.5.0 (git b0275383, #1030; 0.4.4 has none). Upstream fixed it
in 0.6.4 with three commits: 1171888e (#1447), 6bf878cb (#1432) and 73a1291a (#1453), the last of which
contains the other two.

Fix:
* ``BatchTurboQuantKVCache.is_trimmable`` returns True and ``trim(n)`` moves the shared write index
  ``_idx`` and every row's ``offset`` back by ``min(n, _idx)`` and returns that count. The packed slots
  behind ``_idx`` are simply overwritten by the next update (``update_and_fetch`` writes at ``_idx``).
  The original methods are not called: they do nothing but report "not trimmable".
* ``zero_row_tail(batch_index, start, end)`` is added to both TurboQuant caches: it zeroes one row's
  packed slots ``[start, end)`` in every array of the (possibly nested) codec state, so they dequantize
  to 0, as 0.6.4 does; the single-row cache also drops its cached state slice.
* Gemma 4's ``LanguageModel.rollback_speculative_cache``: a delta around the original. Batch TurboQuant
  caches are handed to the original as ``None`` (which it skips), so it rolls back every other cache as
  before and returns the number of accepted drafts; the held-back caches are then trimmed and their
  rejected row tails zeroed, which is what the original does to a dense batch cache and what 0.6.4–0.6.17
  do through ``zero_row_tail``. Known limit, shared with dense caches and with those releases: a zeroed
  slot still takes part in the softmax with score 0 (upstream issue #1962; 0.7.0+ refuses ragged
  acceptance instead). With uniform acceptance nothing is zeroed and the rollback is exact.
* Not patched: Qwen 3.5's rollback has the same item assignment, but its module cannot be imported on
  non-Metal backends from 0.6.0 (it builds Metal kernels at import), which kvpatch's target import does
  not survive. Measured on 0.5.0: with this patch its batch TurboQuant caches roll back when all rows
  accept the same number of drafts (unpatched: ``IndexError``, they are taken for SSM caches); ragged
  acceptance still raises the ``TypeError`` above.

Why adding methods is safe: ``is_trimmable()`` becoming True is the point of the fix (mlx-lm's
``can_trim_prompt_cache`` and Qwen 3.5's rollback ask it, and trimming now works). ``zero_row_tail``
is only looked up by rollback code (mlx-vlm 0.6.4+ and downstream servers use ``getattr``/``hasattr``
on it to pick the zeroing path, and Qwen 3.5's 0.6.4+ rollback uses its presence to tell KV caches from
SSM caches, which is right for both TurboQuant caches); mlx-lm and mlx-vlm 0.5.0–0.6.3 never look for it.
``trim``, ``zero_row_tail`` and the rollback run once per layer (or once) per speculative round: they
are plain functions that add no host synchronisation (the rollback reads the per-row acceptance counts
the original has just synchronised on).
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _reproduce
from kvpatch.patches._numbers import difference, exact, judge
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="tq-trim",
    summary="batch TurboQuant cache not trimmable, TQ caches lack zero_row_tail: rollback keeps rejected tokens",
    distribution="mlx-vlm",
    affected=">=0.5.0,<0.6.4",
    fixed_in="0.6.4",
    fixed_commit="73a1291a",
    introduced_commit="b0275383",
    reference="Blaizzy/mlx-vlm#1453",
    catalogue="V05+V06",
    hot_path=True,
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-vlm < 0.6.4 (and git pins before 73a1291a)",
        review_by=_dt.date(2027, 6, 1),
    ),
)


def _leaves(state: Any) -> list[Any]:
    """Every array of a (possibly nested) TurboQuant state; all have the token axis at position 2."""
    if state is None:
        return []
    if isinstance(state, tuple):
        return [leaf for item in state for leaf in _leaves(item)]
    return [state]


def _zero_slots(cache: Any, batch_index: int, start: int, end: int) -> None:
    if start >= end:
        return
    for leaf in _leaves(cache.keys) + _leaves(cache.values):
        leaf[batch_index, :, start:end] = 0  # in place, like the cache's own writes


@PATCH.replace("mlx_vlm.turboquant", "BatchTurboQuantKVCache.is_trimmable")
def _build_is_trimmable(original: Any) -> Any:  # the original only answers False
    def is_trimmable(self: Any) -> bool:
        return True

    return is_trimmable


@PATCH.replace("mlx_vlm.turboquant", "BatchTurboQuantKVCache.trim")
def _build_trim(original: Any) -> Any:  # the original returns 0 and changes nothing
    def trim(self: Any, n: int) -> int:
        n = max(0, min(self._idx, n))
        if n:
            self._idx -= n
            self.offset = self.offset - n  # a new array: the old one may be shared (state, extend)
        return n

    return trim


@PATCH.add("mlx_vlm.turboquant", "BatchTurboQuantKVCache.zero_row_tail")
def _build_batch_zero_row_tail(original: None) -> Any:
    def zero_row_tail(self: Any, batch_index: int, start: int, end: int) -> None:
        _zero_slots(self, batch_index, start, end)

    return zero_row_tail


@PATCH.add("mlx_vlm.turboquant", "TurboQuantKVCache.zero_row_tail")
def _build_zero_row_tail(original: None) -> Any:
    def zero_row_tail(self: Any, batch_index: int, start: int, end: int) -> None:
        _zero_slots(self, batch_index, start, end)
        self._cached_state = None  # the cached slice of the state predates the zeroing
        self._cached_state_offset = -1

    return zero_row_tail


@PATCH.replace("mlx_vlm.models.gemma4.language", "LanguageModel.rollback_speculative_cache", optional=True)
def _build_rollback(original: Any) -> Any:
    import mlx.core as mx
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    def rollback_speculative_cache(self: Any, caches: Any, gdn_states: Any, accepted: Any, block_size: int) -> int:
        held = [c for c in caches if isinstance(c, BatchTurboQuantKVCache)]
        if not held:
            return original(self, caches, gdn_states, accepted, block_size)
        rest = [None if isinstance(c, BatchTurboQuantKVCache) else c for c in caches]
        max_accepted = original(self, rest, gdn_states, accepted, block_size)
        n = max_accepted + 1  # slots of this round that stay
        drop = block_size - n
        # The original has already waited for ``accepted`` (``accepted.max().item()``): reading its few
        # values back adds no stall, and lets rows that accepted every kept draft skip all work.
        rows = accepted.tolist() if isinstance(accepted, mx.array) else accepted
        rows = [rows] if isinstance(rows, int) else list(rows)
        for cache in held:
            if drop > 0:
                cache.trim(drop)
            if len(rows) > 1 and max_accepted > 0 and cache.keys is not None:
                end = cache._idx
                for row, kept in enumerate(rows):
                    _zero_slots(cache, row, end - n + kept + 1, end)  # no-op for kept == max_accepted
        return max_accepted

    return rollback_speculative_cache


@PATCH.reproduce
def reproduce() -> Finding:
    """Roll a left-padded batch TurboQuant cache back over 3 draft tokens and decode one more token: the
    attention output must equal that of a cache that never saw the drafts. Both TurboQuant caches must
    offer ``zero_row_tail``, and it must zero exactly the named slots."""
    import mlx.core as mx

    try:
        from mlx_vlm.turboquant import BatchTurboQuantKVCache, TurboQuantKVCache
    except ImportError as exc:
        return _reproduce.absent(exc, "this mlx-vlm has no BatchTurboQuantKVCache")

    mx.random.seed(0)
    H, D, T, bits = 2, 32, 6, 4
    left_padding = [2, 0]
    prompt_k, prompt_v = mx.random.normal((2, H, T, D)), mx.random.normal((2, H, T, D))
    draft_k, draft_v = mx.random.normal((2, H, 3, D)), mx.random.normal((2, H, 3, D))
    step_k, step_v, q = (mx.random.normal((2, H, 1, D)) for _ in range(3))
    lp = mx.array(left_padding)

    def decode(cache: Any) -> Any:
        ks, vs = cache.update_and_fetch(step_k, step_v)
        k, v = cache.dequantize(ks, vs)
        return _reproduce.left_padded_attention(q, k.astype(q.dtype), v.astype(q.dtype), lp, D**-0.5)

    problems = []
    rolled = BatchTurboQuantKVCache(left_padding, bits=bits)
    rolled.update_and_fetch(prompt_k, prompt_v)
    rolled.update_and_fetch(draft_k, draft_v)
    trimmable, trimmed = rolled.is_trimmable(), rolled.trim(3)
    if not trimmable or trimmed != 3:
        problems.append(f"batch cache: is_trimmable()={trimmable}, trim(3) returned {trimmed}")
    never = BatchTurboQuantKVCache(left_padding, bits=bits)
    never.update_and_fetch(prompt_k, prompt_v)
    out, ref = decode(rolled), decode(never)
    found = None
    if out.shape != ref.shape:
        problems.append(f"decode after rollback has shape {out.shape}, never-appended {ref.shape}")
    else:
        where = f"decode after rollback over {rolled._idx} slots, never-appended over {never._idx}"
        found = difference(out, ref, where=where)

    for cls, left in ((BatchTurboQuantKVCache, (left_padding,)), (TurboQuantKVCache, ())):
        cache = cls(*left, bits=bits)
        cache.update_and_fetch(prompt_k, prompt_v)
        before = cache.dequantize()[0]
        try:
            cache.zero_row_tail(1, 3, T)
        except AttributeError as exc:  # the bug's own error: the method is missing
            problems.append(f"{cls.__name__}.zero_row_tail: AttributeError: {symptom(exc, 'zero_row_tail')}")
            continue
        after = cache.dequantize()[0]
        target = (mx.arange(2)[:, None, None, None] == 1) & (mx.arange(T)[None, None, :, None] >= 3)
        if not exact(after, mx.where(target, 0, before)):
            problems.append(f"{cls.__name__}.zero_row_tail(1, 3, {T}) changes other slots or leaves its own")
    return judge(
        found,
        "decode after rollback differs from the never-appended cache",
        "trim(3) rolls the batch cache back to the never-appended decode; zero_row_tail zeroes exactly its slots on "
        "both caches",
        problems=problems,
    )
