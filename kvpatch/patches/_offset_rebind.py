"""Shared by offset-rebind (mlx-lm) and offset-rebind-vlm (mlx-vlm's batch caches).

The batch caches advance ``offset`` with ``self.offset += S`` (and ``-=`` when right padding is rolled
away), and ``+=`` on an ``mx.array`` updates that array object in place: every name a model bound to
``cache.offset`` before ``update_and_fetch`` then reads the new value. Not a patch unit (units live in the
distribution folders).
"""

from __future__ import annotations

from typing import Any


def build(original: Any) -> Any:
    """``update_and_fetch`` that gives the cache a new handle on its offset before the original runs.

    ``mx.array(a)`` is a second handle on the same (possibly lazy) array: no copy of data, no graph node,
    no evaluation. The original's in-place arithmetic then lands on that handle; the one a caller kept
    keeps the value it had.
    """
    import mlx.core as mx

    handle = mx.array

    def update_and_fetch(self: Any, keys: Any, values: Any) -> Any:
        self.offset = handle(self.offset)
        return original(self, keys, values)

    return update_and_fetch


def check(caches: dict[str, Any]) -> tuple[bool, str]:
    """For each cache: prefill 3 tokens, keep ``cache.offset`` (as a model does before ``update_and_fetch``),
    decode one more and prefill two more tokens, and see whether the kept handle still holds its value."""
    import mlx.core as mx

    k1, k2 = mx.random.split(mx.random.key(0))
    B, H, D = 2, 2, 64
    prompt = mx.random.normal((B, H, 3, D), key=k1)
    more = mx.random.normal((B, H, 2, D), key=k2)
    moved, notes = [], []
    for name, cache in caches.items():
        cache.update_and_fetch(prompt, prompt + 1)
        for step in (more[:, :, :1], more):  # a decode step (S=1), then a 2-token chunk
            kept = cache.offset
            want = kept.tolist()
            cache.update_and_fetch(step, step + 1)
            got = kept.tolist()
            if got != want:
                moved.append(name)
                notes.append(
                    f"{name}: offset kept before update_and_fetch(S={step.shape[2]}) was {want}, reads {got} after"
                )
                break
        else:
            notes.append(f"{name}: kept offset unchanged ({want}); cache offset now {cache.offset.tolist()}")
    return bool(moved), "; ".join(notes)
