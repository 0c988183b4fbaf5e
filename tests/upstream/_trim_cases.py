"""batch-trim-capped's cases on a tiny random-weight llama (hidden 64, 2 layers), for mlx-lm's ``BatchKVCache`` and
mlx-vlm's own copy (``vlm-batch-trim-capped``): each test file names the cache module it drives.

* the catalogue case: rows holding 1 and 5 tokens (``left_padding=[4, 0]``), ``trim(2)``: the next steps give the
  logits of caches that never appended the trimmed tokens (row 0 empty, row 1 its first 3);
* the ordinary speculative rollback (every row appended 3 draft tokens, ``trim(3)``) still gives the never-appended
  logits;
* the replacement reads no array back to the host (no ``item``/``tolist``/``eval``/``async_eval``).
"""

from __future__ import annotations

from typing import Any

from kvpatch.testing import difference

SHORT, LONG = [9], [7, 3, 22, 41, 8]
STEPS = [[11, 12], [30, 31], [40, 41]]


def _batch(model: Any, caches: Any, prompts: list[list[int]]) -> list[Any]:
    import mlx.core as mx

    width = max(map(len, prompts))
    padding = [width - len(p) for p in prompts]
    batch = [caches.BatchKVCache(padding) for _ in model.layers]
    model(mx.array([[0] * pad + p for pad, p in zip(padding, prompts, strict=True)]), cache=batch)
    return batch


def _alone(model: Any, caches: Any, prefix: list[int], tokens: list[int]) -> list[Any]:
    import mlx.core as mx

    cache = [caches.KVCache() for _ in model.layers]
    if prefix:
        model(mx.array([prefix]), cache=cache)
    return [model(mx.array([[t]]), cache=cache)[0, -1] for t in tokens]


def _compare(model: Any, caches: Any, batch: list[Any], kept: list[list[int]]) -> None:
    """Decode STEPS through ``batch``; row r must match a cache that only ever held ``kept[r]``."""
    import mlx.core as mx

    want = [_alone(model, caches, kept[r], [s[r] for s in STEPS]) for r in range(2)]
    for step, tokens in enumerate(STEPS):
        logits = model(mx.array([[t] for t in tokens]), cache=batch)[:, -1]
        for r in range(2):
            found = difference(logits[r], want[r][step], where=f"row {r}, step {step}, from the never-appended cache")
            assert found.within, found


def trim_past_a_short_row(model: Any, caches: Any) -> None:
    batch = _batch(model, caches, [SHORT, LONG])
    assert [c.trim(2) for c in batch] == [2, 2]
    assert all(c.offset.tolist() == [0, 3] for c in batch)
    assert all(max(c.left_padding.tolist()) <= c._idx for c in batch)
    _compare(model, caches, batch, [[], LONG[:3]])


def ordinary_rollback_unchanged(model: Any, caches: Any) -> None:
    import mlx.core as mx

    batch = _batch(model, caches, [SHORT, LONG])
    model(mx.array([[5, 6, 7], [8, 9, 10]]), cache=batch)  # three draft tokens per row, all rejected
    assert [c.trim(3) for c in batch] == [3, 3]
    assert all(c.offset.tolist() == [1, 5] for c in batch)
    _compare(model, caches, batch, [SHORT, LONG])


def no_host_sync(caches: Any) -> None:
    names = set(caches.BatchKVCache.trim.__code__.co_names)
    assert not names & {"item", "tolist", "eval", "async_eval"}, names
