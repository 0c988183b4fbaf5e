"""prompt-cache-key-overrun beyond the reproduction: ``mlx_lm.server.ResponseGenerator`` driven in-process
with a tiny llama and a draft (so requests go through the speculative ``_serve_single`` path). Request 2
extends request 1's prompt + completion; answered from the prompt cache it must equal what a server with
an empty prompt cache answers. Also: a rotating cache past its window that cannot be trimmed to its key is
not stored.
"""

from __future__ import annotations

import pytest
from _mlx_lm_server import Server, tiny_llama

from kvpatch.patches._prompt_cache import prompt_cache_class
from kvpatch.patches.mlx_lm.prompt_cache_key_overrun import PATCH

pytestmark = pytest.mark.requires_patch(PATCH.id)


def test_next_turn_from_a_speculative_entry_equals_an_empty_cache():
    main, draft = tiny_llama(), tiny_llama(noise=0.05)
    served = Server(main, draft)
    try:
        first = served.ask("hello world")
        assert "tokens" in first, first
        follow = "hello world" + "".join(chr(t) for t in first["tokens"]) + " and more"
        second = served.ask(follow)
    finally:
        served.close()
    fresh = Server(main, draft)
    try:
        want = fresh.ask(follow)
    finally:
        fresh.close()
    assert "tokens" in want, want
    assert second == want, f"served from the prompt cache: {second}; from an empty cache: {want}"


def test_untrimmable_short_cache_is_not_stored():
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    c = RotatingKVCache(max_size=4)
    kv = mx.random.normal((1, 1, 6, 8), key=mx.random.key(0))
    c.update_and_fetch(kv, kv)  # 6 tokens through a 4-token window: not trimmable any more
    lru = prompt_cache_class()()
    lru.insert_cache("m", list(range(7)), [c])  # a key one token longer than the cache has seen
    cache, rest = lru.fetch_nearest_cache("m", list(range(8)))
    assert cache is None and len(rest) == 8
