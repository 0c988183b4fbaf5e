"""Shared by batch-filter-unprimed (mlx-lm) and batch-filter-unprimed-vlm (mlx-vlm's copies): one bug in both
origins of the dense / uniform-quantized batch caches (the TurboQuant twin is ``tq-filter-unprimed``, V13).

Upstream ``filter`` drops the leading padding every kept row shares by subtracting ``min(left_padding)``
from the write index ``_idx`` (and from ``left_padding``), also when fewer slots than that have been
written: a cache filtered before its first update gets a negative ``_idx``. Not a patch unit (units live in the
distribution folders).
"""

from __future__ import annotations

from typing import Any

from kvpatch.patches._numbers import Difference, difference, worst


def cap_shift_at_written(original: Any, refresh: Any = None) -> Any:
    """A builder: ``filter`` that gives back what the original shifted beyond the written slots.

    If the original left ``_idx`` below 0 it dropped more leading slots than had been written; the
    excess goes back into ``left_padding`` and ``_idx`` becomes 0, which is the state a shift capped at
    ``_idx`` gives (mlx-vlm 0.7.8's fix): nothing written, every kept row keeps its own padding.
    ``_idx`` is a Python int in every class this is used on, so the check costs no host sync; when it
    is >= 0 (every primed cache with consistent padding) nothing is changed. ``refresh(cache)``, where given,
    runs after a change (a class that derives state from ``_idx`` / ``left_padding``).
    """

    def filter(self: Any, batch_indices: Any) -> Any:
        result = original(self, batch_indices)
        if self._idx < 0:
            excess = -self._idx
            self._idx = 0
            self.left_padding = self.left_padding + excess
            if refresh is not None:
                refresh(self)
        return result

    return filter


def _attention(cache: Any, step: Any, stored: Any) -> Any:
    """Attention of ``step`` (queries = the step's keys) over what ``update_and_fetch`` returned, masked by the
    cache's own left padding and causality (built here, not with the cache's ``make_mask``). A padding query
    also sees itself, so no query row is fully masked (which would give NaN and hide differences)."""
    import mlx.core as mx

    keys, values = stored
    if isinstance(keys, tuple):  # a uniform quantized cache: (packed, scales, biases)
        keys = mx.dequantize(*keys, group_size=cache.group_size, bits=cache.bits)
        values = mx.dequantize(*values, group_size=cache.group_size, bits=cache.bits)
    n, length = step.shape[2], keys.shape[2]
    k_pos = mx.arange(length)[None, None, None, :]
    q_pos = mx.arange(length - n, length)[None, None, :, None]
    mask = (k_pos <= q_pos) & ((k_pos >= cache.left_padding[:, None, None, None]) | (k_pos == q_pos))
    return mx.fast.scaled_dot_product_attention(step, keys, values, scale=step.shape[-1] ** -0.5, mask=mask)


def filtered_then_fresh(cls: Any, make: Any, steps: Any) -> tuple[list[str], Difference | None]:
    """For reproductions: what differs between a cache made with rows padded ``[0, 3, 1]`` and filtered to rows 1
    and 2 before any update, and ``make([3, 1])``: write index, padding and offset after ``filter`` (the structural
    problems), then every step's attention output (the worst difference). :func:`~kvpatch.patches._numbers.judge`
    takes both.

    ``make(left_padding)`` builds a ``cls``; ``steps`` are key tensors (B=2), the values are their negatives.
    Only what the bug raises (``ValueError: [broadcast_shapes]``) counts as a problem; anything else
    propagates (the engine then calls the finding inconclusive)."""
    import mlx.core as mx

    from kvpatch.record import symptom

    filtered = make([0, 3, 1])
    filtered.filter(mx.array([1, 2]))
    fresh = make([3, 1])
    got = (filtered._idx, filtered.left_padding.tolist(), filtered.offset.tolist())
    want = (fresh._idx, fresh.left_padding.tolist(), fresh.offset.tolist())
    problems = []
    if got != want:
        problems.append(
            f"{cls.__name__} after filter: _idx={got[0]} left_padding={got[1]} offset={got[2]} (a fresh cache of "
            f"the kept rows: _idx={want[0]} left_padding={want[1]} offset={want[2]})"
        )
    found = []
    try:
        for i, step in enumerate(steps):
            outs = [_attention(c, step, c.update_and_fetch(step, -step)) for c in (filtered, fresh)]
            found.append(difference(outs[0], outs[1], where=f"{cls.__name__} step {i} (attention)"))
    except ValueError as exc:
        problems.append(f"the next update raises ValueError: {symptom(exc, 'broadcast_shapes')}")
    return problems, worst(found)
