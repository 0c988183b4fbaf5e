"""batch-quantized-prepare (catalogue V09): the batch quantized cache has no ``prepare()`` / ``finalize()``.

Broken: mlx-vlm's continuous batching prefills prompts of different lengths right-padded and declares the
padding on every layer cache with ``prepare(right_padding=..., lengths=...)``, then rolls it into left
padding with ``finalize()`` once the prefill is done (``BatchKVCache`` / ``BatchRotatingKVCache`` have
both). ``mlx_vlm.models.cache.BatchQuantizedKVCache`` (``--kv-bits``) has neither, so a right-padded
multi-row prefill with kv-bits fails. Measured (Linux, mlx[cpu], mlx-lm 0.31.3): calling ``prepare`` on it
(as ``CacheList.prepare`` does) raises ``AttributeError: 'BatchQuantizedKVCache' object has no attribute
'prepare'`` in 0.5.0 (the class first appears there, b0275383), 0.6.0 and 0.6.4; 0.6.5 has both methods
(Blaizzy/mlx-vlm#1568, c84cf87b) and a right-padded prefill there equals the left-padded one. By reading
the callers: ``generate/ar.py`` (``generate.py`` in 0.5.0) raises ``RuntimeError: APC mixed prefill
requires a prompt cache with prepare()`` and the Qwen MTP drafter ``ValueError: Qwen MTP ragged batch
acceptance requires a batch-aware cache``.

Fix: the two missing methods are added, with the contract of ``BatchKVCache``'s: ``prepare`` adds left
padding to an empty cache and records a right padding that is not all zero; ``finalize`` rolls each row's
packed keys/values (weights, scales and biases alike, along the sequence axis) right by its padding, so
the padded tail wraps out of the valid window, and moves the padding from ``offset`` into
``left_padding``. The roll is kvpatch's own (``take_along_axis``). Because the cache now holds pending
padding, ``filter`` is also given a delta that filters it with the rows (otherwise this patch would
introduce catalogue V10 into these releases); it composes with ``vlm-filter-right-padding`` in 0.6.4.

Why adding methods is safe: every check that flips is ``hasattr``/``getattr(c, "prepare"/"finalize")`` on
a prompt cache, in ``generate`` / ``generate/ar.py`` (APC mixed prefill), ``CacheList``, the Qwen 3.5
verify rollback, and the Eagle3 and Qwen MTP drafters; with the methods present each takes the same
branch it takes in 0.6.5, where upstream added the same two methods with the same signatures. Nothing
uses ``prepare``/``finalize`` as a capability gate for anything else (mlx-lm's ``BatchGenerator`` builds
its own caches; ``hasattr(cache, "merge")`` is not touched). ``prepare`` and ``finalize`` run once per
prefill, ``filter`` when the batch changes: none is per token.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _pending, _reproduce
from kvpatch.patches._numbers import difference, exact, judge
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="batch-quantized-prepare",
    summary="BatchQuantizedKVCache has no prepare()/finalize(): right-padded multi-row prefill with kv-bits fails",
    distribution="mlx-vlm",
    affected=">=0.5.0,<0.6.5",
    fixed_in="0.6.5",
    fixed_commit="c84cf87b",
    introduced_commit="b0275383",
    reference="Blaizzy/mlx-vlm#1568",
    catalogue="V09",
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-vlm < 0.6.5 (and git pins before c84cf87b)",
        review_by=_dt.date(2027, 6, 1),
    ),
)


def _roll_right(x: Any, shift: Any) -> Any:
    """Roll ``x`` (B, H, S, W) right along axis 2 by a per-row ``shift`` (B,), wrapping around."""
    import mlx.core as mx

    slots = x.shape[2]
    source = (mx.arange(slots)[None, :] - shift[:, None]) % slots
    return mx.take_along_axis(x, source[:, None, :, None], axis=2)


@PATCH.add("mlx_vlm.models.cache", "BatchQuantizedKVCache.prepare")
def _build_prepare(_: Any) -> Any:
    return _pending.prepare()


@PATCH.add("mlx_vlm.models.cache", "BatchQuantizedKVCache.finalize")
def _build_finalize(_: Any) -> Any:
    def finalize(self: Any) -> None:
        padding = getattr(self, "_right_padding", None)
        if padding is None:
            return
        if self.keys is not None:
            self.keys = tuple(_roll_right(part, padding) for part in self.keys)
            self.values = tuple(_roll_right(part, padding) for part in self.values)
        self.offset = self.offset - padding
        self.left_padding = self.left_padding + padding
        self._right_padding = None

    return finalize


PATCH.replace("mlx_vlm.models.cache", "BatchQuantizedKVCache.filter")(_pending.filter_pending("_right_padding"))


@PATCH.reproduce
def reproduce() -> Finding:
    """Prefill rows of 4 and 2 tokens right-padded with prepare()/finalize(), decode one token, and compare
    with the same rows prefilled left-padded: offset, left padding, valid keys/values and attention output."""
    import mlx.core as mx

    try:
        from mlx_vlm.models.cache import BatchQuantizedKVCache
    except ImportError as exc:
        return _reproduce.absent(exc, "this mlx-vlm has no BatchQuantizedKVCache")

    mx.random.seed(0)
    heads, dim, group_size, bits, width = 2, 32, 32, 8, 4
    lengths = [4, 2]
    tokens_k = mx.random.normal((2, heads, width, dim))
    tokens_v = mx.random.normal((2, heads, width, dim))
    step_k, step_v = mx.random.normal((2, heads, 1, dim)), mx.random.normal((2, heads, 1, dim))
    queries = mx.random.normal((2, heads, 1, dim))
    # right-padded rows: valid tokens first; left-padded rows: the same valid tokens last
    right_k, right_v = tokens_k, tokens_v
    left_k = mx.concatenate([mx.roll(tokens_k[i : i + 1], width - n, axis=2) for i, n in enumerate(lengths)])
    left_v = mx.concatenate([mx.roll(tokens_v[i : i + 1], width - n, axis=2) for i, n in enumerate(lengths)])

    def decode(cache: Any) -> tuple[Any, Any, Any]:
        qk, qv = cache.update_and_fetch(step_k, step_v)
        k = mx.dequantize(*qk, group_size=group_size, bits=bits)
        v = mx.dequantize(*qv, group_size=group_size, bits=bits)
        return k, v, _reproduce.left_padded_attention(queries, k, v, cache.left_padding, dim**-0.5)

    reference = BatchQuantizedKVCache([width - n for n in lengths], group_size=group_size, bits=bits)
    reference.update_and_fetch(left_k, left_v)
    ref_state = (reference.offset.tolist(), reference.left_padding.tolist())
    ref_k, ref_v, ref_out = decode(reference)

    cache = BatchQuantizedKVCache([0, 0], group_size=group_size, bits=bits)
    try:
        cache.prepare(right_padding=[width - n for n in lengths], lengths=lengths)
        cache.update_and_fetch(right_k, right_v)
        cache.finalize()
        state = (cache.offset.tolist(), cache.left_padding.tolist())
        k, v, out = decode(cache)
    except AttributeError as exc:  # the bug's own error: no prepare()/finalize() on the quantized batch cache
        detail = symptom(exc, "has no attribute 'prepare'", "has no attribute 'finalize'")
        return Finding(True, f"right-padded prefill raises AttributeError: {detail}")
    if state != ref_state:
        return Finding(True, f"after finalize offset/left_padding={state}, left-padded prefill {ref_state}")
    # the same tokens quantized in the same groups (along the head dimension): the same codes, wherever they sit
    moved = [
        row
        for row, pad in enumerate(reference.left_padding.tolist())
        if not (exact(k[row, :, pad:], ref_k[row, :, pad:]) and exact(v[row, :, pad:], ref_v[row, :, pad:]))
    ]
    return judge(
        difference(out, ref_out, where="the next decode step"),
        "right-padded prefill decodes differently from the left-padded one",
        "right-padded prefill + finalize equals the left-padded prefill",
        problems=[f"row {row}: cached keys/values differ from the left-padded prefill" for row in moved],
    )
