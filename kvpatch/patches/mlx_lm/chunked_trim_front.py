"""chunked-trim-front (catalogue H1): ChunkedKVCache.maybe_trim_front trims by the buffer length.

Broken: ``mlx_lm.models.cache.ChunkedKVCache`` (llama4's chunked-attention layers) allocates its key
buffer in steps of 256 positions, but ``maybe_trim_front`` measures the cache by ``keys.shape[2]`` (the
buffer) instead of the tokens it holds (``offset - start_position``). On the first decode step after a
short prompt the whole unused tail counts as cached tokens: 0.23.2–0.31.3 advance ``start_position`` by
``256 - chunk_size`` and keep the last ``chunk_size`` buffer slots (zeros); 0.22.5 drops the first
``chunk_size`` slots per call. Measured with chunk_size 4, a 3-token prompt and 6 decode steps:
``start_position=252`` with ``offset=9`` and no keys returned (0.23.2–0.31.3), ``start_position=24`` and 217
keys of buffer garbage (0.22.5); both already return no valid key on the first decode step. Every chunked
layer then attends to nothing valid (llama4's logits differ from the uncached forward from that step on).
ChunkedKVCache first ships in 0.22.5 (absent in 0.22.4).

Upstream: ml-explore/mlx-lm#1673 (e03e45ed), released in 0.32.0 (measured clean on 0.32.0 and 0.32.2).

Fix: a delta in front of the original, which keeps its own trimming rule (0.22.5 drops whole chunks,
0.23.2+ keep the last ``chunk_size`` tokens; both keep every key the current chunk needs). Nothing is trimmed while the
cache holds at most ``chunk_size`` tokens (the original would cut into the unused buffer tail); above
that, the buffer is first cut to the tokens it holds (``[:offset - start_position]``), so the original
measures and trims real tokens. Python ints and a slice only: no host synchronisation. Called once per
chunked layer per forward pass, so it is a hot path; the extra cost is the re-allocation of the
256-step buffer on the next update once the cache is above ``chunk_size``, which upstream's own fix
has too.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches._numbers import exact
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="chunked-trim-front",
    summary="ChunkedKVCache.maybe_trim_front trims by the 256-step buffer length instead of the cached tokens",
    distribution="mlx-lm",
    affected=">=0.22.5,<0.32.0",
    fixed_in="0.32.0",
    fixed_commit="e03e45ed",
    reference="ml-explore/mlx-lm#1673",
    catalogue="H1",
    hot_path=True,
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-lm < 0.32.0",
        review_by=_dt.date(2027, 6, 1),
    ),
)


@PATCH.replace("mlx_lm.models.cache", "ChunkedKVCache.maybe_trim_front")
def _build(original: Any) -> Any:
    def maybe_trim_front(self: Any) -> Any:
        if self.keys is not None:
            held = self.offset - self.start_position
            if held <= self.chunk_size:
                return None
            if self.keys.shape[2] != held:
                self.keys = self.keys[..., :held, :]
                self.values = self.values[..., :held, :]
        return original(self)

    return maybe_trim_front


@PATCH.reproduce
def reproduce() -> Finding:
    """llama4's order per step (maybe_trim_front, then update): returned keys must be the real tail."""
    import mlx.core as mx
    from mlx_lm.models.cache import ChunkedKVCache

    mx.random.seed(0)
    chunk = 4
    cache = ChunkedKVCache(chunk)
    history = []
    problems = []
    for step, n in enumerate([3, 1, 1, 1, 1, 1, 1]):  # a 3-token prompt, then 6 decode steps
        k = mx.random.normal((1, 2, n, 8))
        history.append(k)
        cache.maybe_trim_front()
        keys, _ = cache.update_and_fetch(k, k + 1)
        full = mx.concatenate(history, axis=2)
        start, offset = cache.start_position, cache.offset
        held = keys.shape[2]
        # It must return the real keys [start, offset), reaching back to the chunk of this step's first query.
        needed_from = (offset - n) // chunk * chunk
        if not (0 <= start <= needed_from and held == offset - start):
            problems.append(f"step {step}: start_position={start}, offset={offset}, {held} keys returned")
        elif not exact(keys, full[..., start:offset, :]):
            problems.append(f"step {step}: returned keys differ from positions {start}..{offset - 1}")
        if problems:
            break
    if problems:
        return Finding(True, "; ".join(problems))
    return Finding(
        False, f"every step (chunk {chunk}) returns the real keys back to its chunk start ({held} at the end)"
    )
