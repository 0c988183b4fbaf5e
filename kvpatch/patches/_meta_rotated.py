"""Shared by rotating-meta-rotated (mlx-lm) and vlm-rotating-meta-rotated (mlx-vlm's copy): one bug, two classes.

``BatchRotatingKVCache.meta_state`` writes ``rotated`` as ``str(bool)`` and its setter reads it back with
``bool(v[3])``; ``bool("False")`` is true. Not a patch unit (units live in the distribution folders).
"""

from __future__ import annotations

from typing import Any

from kvpatch.patches._numbers import difference, judge
from kvpatch.record import Finding


def build_setter(original: Any) -> Any:
    """A ``meta_state`` property whose setter runs the original, then reads ``rotated`` back as written."""
    if not isinstance(original, property) or original.fset is None:
        return original  # not the property this patch was written for: decline
    fset = original.fset

    def meta_state(self: Any, v: Any) -> None:
        fset(self, v)
        flag = v[3] if len(v) > 3 else None
        if isinstance(flag, str):
            self.rotated = flag == "True"

    return property(original.fget, meta_state, original.fdel, original.__doc__)


def restore(source: Any, fresh: Any) -> None:
    """Restore ``source`` into ``fresh`` the way prefix caches and ``from_state`` do: ``state``, then
    ``meta_state`` where the class has one (mlx-lm 0.32 keeps everything in ``state``)."""
    fresh.state = source.state
    if hasattr(type(source), "meta_state"):
        fresh.meta_state = source.meta_state


def reproduce(cache_module: Any) -> Finding:
    """Restore a 2-row, left-padded, not-yet-rotated batch rotating cache through ``state`` + ``meta_state``
    into a fresh cache (what prefix-cache restore and ``from_state`` do), decode one token through both and
    compare the ``rotated`` flag and left padding (exact) and the attention outputs (up to rounding)."""
    import mlx.core as mx

    batch_cls = cache_module.BatchRotatingKVCache
    B, H, D, max_size = 2, 2, 8, 16
    k1, k2, k3, k4 = mx.random.split(mx.random.key(0), 4)
    prompt_k = mx.random.normal((B, H, 6, D), key=k1)
    prompt_v = mx.random.normal((B, H, 6, D), key=k2)
    step_k = mx.random.normal((B, H, 1, D), key=k3)
    queries = mx.random.normal((B, H, 1, D), key=k4)

    def filled() -> Any:
        cache = batch_cls(max_size, [2, 0])
        cache.update_and_fetch(prompt_k, prompt_v)
        return cache

    def decode(cache: Any) -> Any:
        mask = cache.make_mask(1, return_array=True)
        k, v = cache.update_and_fetch(step_k, step_k + 1)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=D**-0.5, mask=mask)

    original, source = filled(), filled()  # (a restored cache shares the source's arrays)
    restored = batch_cls(max_size, [0, 0])
    restore(source, restored)
    flags = (original.rotated, restored.rotated)
    want, got = decode(original), decode(restored)
    lp = (original.left_padding.tolist(), restored.left_padding.tolist())
    problems = [] if flags[0] == flags[1] else [f"rotated {flags[0]} saved, {flags[1]} restored"]
    if lp[0] != lp[1]:
        problems.append(f"after one decode step left_padding {lp[1]} (uninterrupted cache {lp[0]})")
    return judge(
        difference(got, want, where="attention output of the next step"),
        "the restored cache decodes differently",
        f"rotated {flags[0]} saved and restored; left_padding {lp[1]} after one decode step, as uninterrupted",
        problems=problems,
    )
