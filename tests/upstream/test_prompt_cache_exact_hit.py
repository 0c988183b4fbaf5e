"""prompt-cache-exact-hit beyond the reproduction: ``mlx_lm.server.ResponseGenerator`` driven in-process (no
HTTP) with a tiny random-weight llama. Request 2 is request 1's prompt plus its completion, an exact hit on
the entry request 1 left; with the patch it must be answered exactly as a server with an empty prompt cache
answers it, and the generation thread must still serve a third request. Also the non-trimmable case (a
recurrent-layer entry) at the prompt-cache level.
"""

from __future__ import annotations

import pytest
from _mlx_lm_server import Server, tiny_llama

from kvpatch.patches._prompt_cache import prompt_cache_class
from kvpatch.patches.mlx_lm.prompt_cache_exact_hit import PATCH
from kvpatch.testing import exact

pytestmark = pytest.mark.requires_patch(PATCH.id)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def test_server_answers_an_exact_hit_like_an_empty_cache(model):
    served = Server(model)
    try:
        first = served.ask("hello world")
        assert "tokens" in first, first
        again = "hello world" + "".join(chr(t) for t in first["tokens"])  # prompt + completion, sent back
        second = served.ask(again, timeout=15)
        third = served.ask("another prompt", timeout=15)
        alive = served.generator._generation_thread.is_alive()
    finally:
        served.close()
    fresh = Server(model)
    try:
        want = fresh.ask(again)
    finally:
        fresh.close()
    assert "tokens" in want, want
    assert second == want, f"exact hit answered {second}, an empty prompt cache answers {want}"
    assert "tokens" in third and alive, f"after the exact hit: {third}, generation thread alive: {alive}"


def test_untrimmable_entry_falls_back_to_a_shorter_one():
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache

    tokens = [5, 9, 2, 33, 17, 21]

    def entry(n):
        c = ArraysCache(size=1)
        c[0] = mx.full((1, 4), float(n))
        return [c]

    lru = prompt_cache_class()()
    lru.insert_cache("m", tokens[:4], entry(4))
    lru.insert_cache("m", tokens[:], entry(6))
    cache, rest = lru.fetch_nearest_cache("m", tokens[:])
    assert list(rest) == tokens[4:] and cache is not None and exact(cache[0][0], entry(4)[0][0])
