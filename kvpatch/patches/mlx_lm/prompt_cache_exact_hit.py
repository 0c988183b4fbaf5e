"""prompt-cache-exact-hit: an exact prompt-cache hit leaves nothing to prefill, and the server dies on it.

Broken: ``LRUPromptCache.fetch_nearest_cache`` (``mlx_lm.server`` in 0.28.4–0.31.1, ``mlx_lm.models.cache``
from 0.31.2) answers a prompt that equals a stored key exactly with the whole cache and an empty remainder.
Generation needs at least one prompt token to produce the first logits, so the server's next step fails
on the empty prompt. The server stores a finished request under prompt + generated tokens, so the hit is
what a client gets when it sends a previous prompt together with its completion back (continuation, or
a retry of a request that was answered). Measured by driving ``mlx_lm.server.ResponseGenerator`` in-process
(no HTTP; tiny random-weight llama, greedy, 8 tokens), request 2 = request 1's prompt + its completion:

* 0.30.4, 0.30.7, 0.31.1 (``[gather] Got indices with invalid dtype``), 0.31.2, 0.31.3 (``IndexError: list
  index out of range`` in ``BatchGenerator.insert_segments``) and 0.32.2 (``ValueError: Sequence 1 has an
  empty prompt``): the generation thread dies; every later request hangs (0.32.2: fails with
  ``generation thread died``).
* 0.28.4 and 0.30.2: that request fails (``ValueError: Either input_embeddings or prompt (or both) must be
  provided``); the thread survives.

mlx-lm 0.28.1 and older keep at least one token in their single-entry prompt cache.

Upstream: reported as ml-explore/mlx-lm#1215; fixes proposed in #1581 (closed), #1596 (inside
``fetch_nearest_cache``, the place this patch uses) and #1887 (server side, open). Not fixed as of 0.32.2.

Fix: a delta around ``fetch_nearest_cache``. When the original returns a cache with an empty remainder for a
non-empty prompt, the last token is given back: a trimmable cache is trimmed by one token and the last
prompt token becomes the remainder; a cache that cannot be trimmed (recurrent layers) is dropped and the
original is asked again for the prompt without its last token (a shorter entry or none), and the last
token is appended to that remainder. Every other answer is passed through untouched. Runs once per
request.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _prompt_cache
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="prompt-cache-exact-hit",
    summary="LRUPromptCache.fetch_nearest_cache returns an empty remainder on an exact hit: server thread dies",
    distribution="mlx-lm",
    affected=">=0.28.4,<=0.32.2",
    checked_through="0.32.2",
    catalogue="N8 (issue 12 item 8)",
    reference="ml-explore/mlx-lm#1596 (issue #1215; also #1581, #1887)",
    expiry=Expiry(
        "retire when fetch_nearest_cache (or the server) keeps at least one prompt token on an exact hit",
        review_by=_dt.date(2027, 3, 1),
    ),
)


def _build_fetch(original: Any) -> Any:
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    def fetch_nearest_cache(self: Any, model: Any, tokens: Any) -> Any:
        cache, rest = original(self, model, tokens)
        if cache is None or len(rest) > 0 or len(tokens) == 0:
            return cache, rest
        if can_trim_prompt_cache(cache):
            trim_prompt_cache(cache, 1)
            return cache, tokens[-1:]
        cache, rest = original(self, model, tokens[:-1])
        return cache, list(rest) + list(tokens[-1:])

    return fetch_nearest_cache


_prompt_cache.replace_method(PATCH, "fetch_nearest_cache", _build_fetch)


@PATCH.reproduce
def reproduce() -> Finding:
    """Store a 2-layer KV cache under 6 tokens, fetch those 6 tokens: the remainder must not be empty and the
    cache plus the remainder must cover the prompt."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    tokens = [5, 9, 2, 33, 17, 21]
    layers = []
    for i in range(2):
        c = KVCache()
        kv = mx.random.normal((1, 2, len(tokens), 8), key=mx.random.key(i))
        c.update_and_fetch(kv, kv + 1)
        layers.append(c)
    lru = _prompt_cache.prompt_cache_class()()
    lru.insert_cache("model", tokens[:], layers)
    cache, rest = lru.fetch_nearest_cache("model", tokens[:])
    if cache is None:
        return Finding(False, inconclusive="the stored entry was not found for its own key")
    cached = cache[0].offset
    detail = f"exact hit on a {len(tokens)}-token key: cache holds {cached} tokens, remainder {list(rest)}"
    if len(rest) == 0:
        return Finding(True, f"{detail}: nothing left to prefill (generation needs at least one token)")
    if cached + len(rest) != len(tokens):
        return Finding(True, f"{detail}: cache + remainder cover {cached + len(rest)} tokens, not {len(tokens)}")
    return Finding(False, detail)
