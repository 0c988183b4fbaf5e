"""lm-filter-right-padding (catalogue L-V10): mlx-lm batch cache ``filter()`` leaves the padding ``prepare()`` declared.

Broken (measured by kvpatch): a right-padded multi-row prefill declares its padding with
``prepare(right_padding=..., lengths=...)``; ``mlx_lm.models.cache.BatchKVCache`` keeps it in ``_right_padding``
and ``BatchRotatingKVCache`` in ``_lengths`` until ``finalize()`` rolls it into ``left_padding``. Their
``filter()`` indexes keys, values, ``offset`` and ``left_padding`` but not that pending state (mlx-lm's own
``ArraysCache.filter`` does filter its pending ``lengths``), so ``finalize()`` broadcasts the old batch's
padding over the new batch. Measured (Linux, mlx[cpu]) on mlx-lm 0.28.4, 0.30.2, 0.30.4, 0.30.7, 0.31.1,
0.31.2, 0.31.3, 0.32.0 and 0.32.2: rows of 4 and 1 tokens padded to 4, ``filter([1])``, ``finalize()``: the
one-row cache ends with ``offset=[4, 1]`` and ``left_padding=[0, 3]`` (the row prefilled alone: ``offset=[1]``,
``left_padding=[3]``) in both classes, and its keys are broadcast back to two rows; the next decode step then
raises (``BatchKVCache``: ``[scaled_dot_product_attention] mismatching batch dimension``;
``BatchRotatingKVCache``: ``[concatenate] ... shapes (2,2,4,32), (1,2,12,32)``).

Range: ``prepare``/``finalize`` and the pending state arrived in 088e7ad7 (ml-explore/mlx-lm#602), first
released in 0.28.4 (0.28.1 has neither: out of range); not fixed in 0.32.2 nor on upstream main of Aug 2026.
mlx-vlm 0.6.3 and older re-export these two classes, so this patch covers them there too; mlx-vlm's own copies
(0.6.4+) are patch ``vlm-filter-right-padding`` (fixed there in 0.6.14, Blaizzy/mlx-vlm#1890).

How users meet it: not through mlx-lm's own generators. ``BatchGenerator`` brackets every right-padded prefill
(``prepare``, the model calls, ``finalize``) inside one call (``_process_prompts`` in 0.28.4-0.30.x,
``PromptProcessingBatch.prompt`` from 0.31), and ``remove``/``split``/``filter`` (also from ``mlx_lm.server``, on
the same generation thread) only run between such calls; instrumented runs with finishing and removed rows saw
no ``filter`` with padding pending. It is met by code that drives the cache API itself and spreads a right-padded
prefill over scheduler steps, dropping a row (finished, cancelled, re-admitted) at a chunk boundary.

Fix: a delta around the original: read the pending state, run the original ``filter``, then set the pending
state to its rows at ``batch_indices``, the same indices the original applied to ``offset``. Nothing changes
when no padding is pending. Over an original that already filters the pending state (or another delta like this
one, e.g. ``vlm-filter-right-padding`` on the same re-exported class) the result is the same, because the value
indexed is the one seen before the inner call. ``filter`` runs when the batch changes, not per token.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import replace
from typing import Any

from kvpatch.patches import _pending
from kvpatch.patches._numbers import Difference, difference, exact, judge, worst
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="lm-filter-right-padding",
    summary="mlx-lm batch cache filter() leaves pending right padding (_right_padding/_lengths) unfiltered",
    distribution="mlx-lm",
    affected=">=0.28.4,<=0.32.2",
    introduced_commit="088e7ad7",
    checked_through="0.32.2",
    reference="not reported upstream",
    catalogue="L-V10",
    expiry=Expiry(
        "retire when mlx-lm's BatchKVCache/BatchRotatingKVCache.filter index _right_padding/_lengths "
        "(set fixed_in then) and kvpatch stops supporting the releases before",
        review_by=_dt.date(2027, 3, 1),
    ),
)

# (class, attribute holding the padding that prepare() declared and finalize() has not applied yet)
PENDING = (("BatchKVCache", "_right_padding"), ("BatchRotatingKVCache", "_lengths"))


_filter_pending = _pending.filter_pending


for _cls, _attribute in PENDING:
    PATCH.replace("mlx_lm.models.cache", f"{_cls}.filter")(_filter_pending(_attribute))


def new_cache(cls_name: str, rows: int) -> Any:
    from mlx_lm.models import cache as cache_module

    cls = getattr(cache_module, cls_name)
    return cls(16, [0] * rows) if cls_name == "BatchRotatingKVCache" else cls([0] * rows)


def prefill_and_decode(cls_name: str, keys: Any, lengths: list[int], keep: Any, step: Any, queries: Any) -> dict:
    """Right-padded prefill of ``keys`` (``lengths`` valid tokens per row), ``filter(keep)`` before ``finalize()``
    (unless ``keep`` is None), then one decode step attending with the cache's own mask. Returns offset,
    left_padding, the valid prefill keys of each row and the decode output (or the exception it raised)."""
    import mlx.core as mx

    cache = new_cache(cls_name, len(lengths))
    cache.prepare(right_padding=[keys.shape[2] - n for n in lengths], lengths=lengths)
    cache.update_and_fetch(keys, -keys)
    if keep is not None:
        cache.filter(keep)
    cache.finalize()
    offset, pad = cache.offset.tolist(), cache.left_padding.tolist()
    batch = cache.keys.shape[0]
    rows = [cache.keys[i, :, p : p + o] for i, (p, o) in enumerate(zip(pad, offset, strict=True)) if i < batch]
    result = {"offset": offset, "left_padding": pad, "rows": rows, "batch": batch}
    try:
        mask = cache.make_mask(1)
        k, v = cache.update_and_fetch(step, -step)
        out = mx.fast.scaled_dot_product_attention(queries, k, v, scale=keys.shape[-1] ** -0.5, mask=mask)
        mx.eval(out)
        result["decode"] = out
    except ValueError as exc:  # kept: it counts only if the cache's bookkeeping is wrong too (see compare)
        result["decode"] = exc
    return result


def compare(got: dict, ref: dict) -> tuple[str | None, Difference | None]:
    """What differs between a filtered cache and the kept rows prefilled alone: the bookkeeping and valid keys (moved
    data: exact; None when they agree), then the next decode step (its difference, None when not compared)."""
    if got["offset"] != ref["offset"] or got["left_padding"] != ref["left_padding"]:
        return (
            f"offset={got['offset']} left_padding={got['left_padding']} (keys B={got['batch']}), "
            f"the rows prefilled alone offset={ref['offset']} left_padding={ref['left_padding']}"
        ), None
    if len(got["rows"]) != len(ref["rows"]):
        return f"keys hold {got['batch']} rows, the rows prefilled alone {ref['batch']}", None
    if not exact(got["rows"], ref["rows"]):
        return "valid keys differ from the rows prefilled alone", None
    out = got["decode"]
    if isinstance(out, Exception):
        # offset, padding and keys are right: an error now is not this bug's symptom (inconclusive)
        raise out
    if out.shape != ref["decode"].shape:
        return f"next decode output shape {out.shape}, alone {ref['decode'].shape}", None
    return None, difference(out, ref["decode"], where="the next decode step")


@PATCH.reproduce
def reproduce() -> Finding:
    """Prefill rows of 4 and 1 tokens right-padded, drop the first row before ``finalize()``, and compare the
    one-row cache with that row prefilled alone: offset, left padding, valid keys and the next decode step."""
    import mlx.core as mx
    from mlx_lm.models import cache as cache_module

    mx.random.seed(0)
    keys = mx.random.normal((2, 2, 4, 32))
    step = mx.random.normal((1, 2, 1, 32))
    queries = mx.random.normal((1, 2, 1, 32))
    problems, checked, found = [], [], []
    for cls_name, _ in PENDING:
        cls = getattr(cache_module, cls_name, None)
        if cls is None or not hasattr(cls, "prepare"):
            continue
        checked.append(cls_name)
        got = prefill_and_decode(cls_name, keys, [4, 1], mx.array([1]), step, queries)
        ref = prefill_and_decode(cls_name, keys[1:], [1], None, step, queries)
        problem, measured = compare(got, ref)
        if problem:
            problems.append(f"{cls_name} after filter([1]) + finalize(): {problem}")
        if measured is not None:
            found.append(replace(measured, where=f"{cls_name} after filter([1]) + finalize(), {measured.where}"))
    if not checked:
        return Finding(False, "no mlx-lm batch cache here has prepare(): nothing to fix")
    return judge(
        worst(found),
        "the next decode differs from the row prefilled alone",
        f"{', '.join(checked)}: after filter+finalize offset, padding, keys and next decode equal the row alone",
        problems=problems,
    )
