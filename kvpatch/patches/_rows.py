"""A batch ``extend`` with an empty side: the fixes and reproductions shared by two pairs of units.

* batch-quantized-extend (V02) and empty-tq-rows (V03): upstream keeps only the other side's packed rows while
  ``offset`` / ``left_padding`` count both. :func:`filling_rows` adds the empty side's rows back (as zeros, which
  its left padding masks); :func:`check_extend` reproduces it.
* batch-extend-empty (mlx-lm, D2+F1) and vlm-batch-extend-dtype (mlx-vlm's copy): upstream pads the empty side
  from float32 placeholders. :func:`stand_in_empty_side` gives it zero-length keys/values like the other side's;
  :func:`check_join` reproduces it.
* batch-merge-empty and merge-all-empty: a merge of rows that all lack keys returns :func:`fresh_batch`.

Not a patch unit (units live in the distribution folders).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpatch.patches import _reproduce
from kvpatch.patches._numbers import Difference, difference, judge, worst
from kvpatch.record import Finding, symptom


def rows(state: Any) -> int | None:
    """Batch size of the first array in a (nested, NamedTuple) cache state."""
    if isinstance(state, tuple):
        for item in state:
            found = rows(item)
            if found is not None:
                return found
        return None
    shape = getattr(state, "shape", None)
    return shape[0] if shape else None


def pad_rows(state: Any, before: int, after: int) -> Any:
    """Insert zero rows along the batch axis of every array in a (nested, NamedTuple) state."""
    import mlx.core as mx

    if isinstance(state, mx.array):
        return mx.pad(state, [(before, after)] + [(0, 0)] * (state.ndim - 1))
    if isinstance(state, tuple):
        items = [pad_rows(item, before, after) for item in state]
        return type(state)(*items) if hasattr(state, "_fields") else tuple(items)
    return state


def fill_missing_rows(cache: Any, self_was_empty: bool, n_self: int, n_other: int) -> None:
    """After ``cache.extend(other)`` with exactly one side empty: give the empty side its rows back.

    Does nothing when the packed state already has a row per batch entry (upstream already fixed).
    """
    missing = n_self if self_was_empty else n_other
    if rows(cache.keys) == n_self + n_other - missing:
        before, after = (missing, 0) if self_was_empty else (0, missing)
        cache.keys = pad_rows(cache.keys, before, after)
        cache.values = pad_rows(cache.values, before, after)


def filling_rows(original: Any) -> Any:
    """Upstream's ``extend`` (``original``) followed by :func:`fill_missing_rows` when exactly one side was empty."""

    def extend(self: Any, other: Any) -> Any:
        self_empty = self.keys is None
        other_empty = other.keys is None
        n_self = self.offset.shape[0]
        n_other = other.offset.shape[0]
        result = original(self, other)
        if self_empty != other_empty and self.keys is not None:
            fill_missing_rows(self, self_empty, n_self, n_other)
        return result

    return extend


def check_extend(new_cache: Callable[[], Any], dequantize: Callable[[Any, Any, Any], Any]) -> Finding:
    """Merge a prefilled and an empty batch cache (both orders), decode one token, and compare each row's
    attention output with the same row decoded in a cache of its own.

    ``new_cache()`` makes an empty one-row cache (2 heads, head dim 32); ``dequantize(cache, keys, values)``
    turns what its ``update_and_fetch`` returns into float keys and values.
    """
    import mlx.core as mx

    mx.random.seed(0)
    H, D, T = 2, 32, 5
    scale = D**-0.5
    prompt_k, prompt_v = mx.random.normal((1, H, T, D)), mx.random.normal((1, H, T, D))
    step_k, step_v = mx.random.normal((2, H, 1, D)), mx.random.normal((2, H, 1, D))
    queries = mx.random.normal((2, H, 1, D))

    def made(prefilled: bool) -> Any:
        cache = new_cache()
        if prefilled:
            cache.update_and_fetch(prompt_k, prompt_v)
        return cache

    def attend(cache: Any, keys: Any, values: Any, q: Any) -> Any:
        k, v = dequantize(cache, *cache.update_and_fetch(keys, values))
        return _reproduce.left_padded_attention(q, k, v, cache.left_padding, scale)

    problems, found = [], []
    for order in ("full.extend(empty)", "empty.extend(full)"):
        full, empty = made(True), made(False)
        merged, other, p_full, p_empty = (full, empty, 0, 1) if order[0] == "f" else (empty, full, 1, 0)
        try:
            merged.extend(other)
            out = attend(merged, step_k, step_v, queries)
            mx.eval(out)
        except ValueError as exc:  # the bug's own error: the empty side's rows are missing from the join
            problems.append(f"{order}: decode raises ValueError: {symptom(exc, 'Cannot broadcast')}")
            continue
        # references: each row decoded alone, with the same step input and query as its batch row
        for prefilled, p in ((True, p_full), (False, p_empty)):
            ref = attend(made(prefilled), step_k[p : p + 1], step_v[p : p + 1], queries[p : p + 1])
            found.append(difference(out[p], ref[0], where=f"{order}, {'prefilled' if prefilled else 'empty'} row"))
    return judge(
        worst(found),
        "merged decode differs from per-row decode",
        "both orders: merged decode equals per-row decode",
        problems=problems,
    )


def stand_in_empty_side(cache: Any, other: Any) -> Any:
    """Before ``cache.extend(other)`` with exactly one side empty: give the empty side zero-length keys/values
    like the other's (:func:`zero_length_like`). Returns the ``other`` to pass on: a copy when it is the empty
    side, so the caller's cache is left as it was."""
    import copy

    if other.keys is None:
        other = copy.copy(other)
        zero_length_like(other, cache)
    elif cache.keys is None:
        zero_length_like(cache, other)
    return other


#: How the bug's join fails when an empty side's keys are None.
_NONE = "'NoneType' object"


def check_join(
    makers: list[tuple[str, Callable[[int], Any]]], dtypes: list[Any]
) -> tuple[list[str], Difference | None]:
    """Join a 2-row cache and an empty 1-row cache both ways, for each ``(name, make(rows))`` and dtype, and decode
    one more token: the joined cache must keep a row per entry and the input dtype, and each row's attention
    output must equal that row's own attention (full rows: their 5 old keys plus the new one; the empty row: the
    new key only), up to the rounding of the dtype. Returns the structural problems and the worst per-row attention
    difference (:func:`~kvpatch.patches._numbers.judge` takes both).

    The reproduction of batch-extend-empty and vlm-batch-extend-dtype (an empty side's stand-ins).
    """
    import mlx.core as mx

    mx.random.seed(0)
    H, D = 2, 8
    base = [mx.random.normal(shape) for shape in [(2, H, 5, D)] * 2 + [(3, H, 1, D)] * 3]

    def attend(q: Any, keys: Any, values: Any, mask: Any = None) -> Any:
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=D**-0.5, mask=mask).astype(mx.float32)

    problems: list[str] = []
    found: list[Difference] = []
    for dtype in dtypes:
        k, v, q_new, k_new, v_new = (a.astype(dtype) for a in base)
        for name, make in makers:
            for empty_first in (False, True):
                full, empty = make(2), make(1)
                full.update_and_fetch(k, v)
                a, b = (empty, full) if empty_first else (full, empty)
                label = f"{name} {dtype}: {'empty.extend(full)' if empty_first else 'full.extend(empty)'}"
                order = [2, 0, 1] if empty_first else [0, 1, 2]  # joined position -> source row (2: the empty one)
                try:
                    a.extend(b)
                    if a.keys.dtype != dtype or a.values.dtype != dtype:
                        problems.append(f"{label}: keys/values come back {a.keys.dtype}/{a.values.dtype}")
                    sizes = (a.keys.shape[0], a.offset.shape[0], a.left_padding.shape[0])
                    if sizes != (3, 3, 3):
                        problems.append(f"{label}: rows of (keys, offset, left_padding) = {sizes}, expected 3 each")
                        continue
                    mask = a.make_mask(1, return_array=True)
                    src = mx.array(order)
                    keys, values = a.update_and_fetch(k_new[src], v_new[src])
                    out = attend(q_new[src], keys, values, mask)
                except AttributeError as exc:  # the bug's own error: an empty side's keys are None
                    problems.append(f"{label} raises AttributeError: {symptom(exc, _NONE)}")
                    continue
                for r in range(2):
                    kk = mx.concatenate([k[r : r + 1], k_new[r : r + 1]], axis=2)
                    vv = mx.concatenate([v[r : r + 1], v_new[r : r + 1]], axis=2)
                    want = attend(q_new[r : r + 1], kk, vv)[0]
                    found.append(difference(out[order.index(r)], want, dtype, where=f"{label}, row {r}"))
                want = attend(q_new[2:], k_new[2:], v_new[2:])[0]
                found.append(difference(out[order.index(2)], want, dtype, where=f"{label}, the empty row"))
    return problems, worst(found)


def zero_length_like(cache: Any, like: Any) -> None:
    """Give an empty batch cache zero-length keys/values in ``like``'s dtype, heads and head dims.

    Shared by batch-extend-empty (mlx-lm, D2+F1) and vlm-batch-extend-dtype (mlx-vlm's copy): upstream's
    ``extend`` pads the empty side from float32 placeholders, so a bf16 batch came back float32.
    """
    import mlx.core as mx

    rows = cache.offset.shape[0]
    heads, k_dim = like.keys.shape[1], like.keys.shape[3]
    cache.keys = mx.zeros((rows, heads, 0, k_dim), dtype=like.keys.dtype)
    cache.values = mx.zeros((rows, heads, 0, like.values.shape[3]), dtype=like.values.dtype)


def fresh_batch(cls: Any, caches: list[Any]) -> Any:
    """What mlx-lm 0.31.2 merges rows without keys into: a fresh ``cls`` of that many rows, no padding; a rotating
    one of the rows' common ``max_size`` (None where the sizes differ: upstream's own error is the answer)."""
    rows = [0] * len(caches)
    if not caches or not hasattr(caches[0], "max_size"):
        return cls(rows)
    if any(c.max_size != caches[0].max_size for c in caches):
        return None
    return cls(caches[0].max_size, rows)
