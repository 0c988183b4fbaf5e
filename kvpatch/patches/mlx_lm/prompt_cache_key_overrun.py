"""prompt-cache-key-overrun: the server files a speculative request's cache under one token more than it holds.

Broken: ``mlx_lm.server`` serves requests with a draft model one at a time (``_serve_single``) and afterwards
stores the prompt cache in its ``LRUPromptCache`` under prompt + every generated token. Speculative decoding
(``speculative_generate_step``) leaves the last emitted token unprocessed: the main model's cache holds one
token fewer than that key (the draft's cache one or two fewer); plain ``generate_step`` processes every
token it yields, so only the speculative path is off. A later request that extends the key (the next
chat turn, a continuation) is answered from that entry with the remainder after the key: the last
generated token is never fed to the model and every later position is shifted by one. Measured by
driving ``ResponseGenerator`` in-process (tiny random-weight llama, a 5%-noise copy as draft, greedy, 8
tokens; request 2 = request 1's prompt + completion + " and more"): the stored entry has a 19-token key
and caches of 18 (main) and 17–18 (draft) tokens, and request 2 answers ``[57, 53, 26, 44, 2, 6, 67, 42]``
where a server with an empty prompt cache answers ``[57, 0, 93, 121, 44, 2, 30, 57]``, on 0.28.4, 0.30.2,
0.30.4, 0.30.7, 0.31.1, 0.31.2, 0.31.3, 0.32.0 and 0.32.2. Servers before 0.28.4 (one ``PromptCache``, no
``LRUPromptCache``) append every generated token to their cached token list the same way (read, not run;
out of this patch's reach).

Upstream: not reported; not fixed as of 0.32.2.

Fix: a delta in front of ``LRUPromptCache.insert_cache`` (``mlx_lm.server`` in 0.28.4–0.31.1,
``mlx_lm.models.cache`` from 0.31.2). The number of tokens the cache holds is the smallest ``offset`` among
its layers that have an integer offset (KV, rotating, quantized caches; a cache with none is passed
through). When the key is longer, every layer is trimmed to that many tokens and the entry is filed under
the key cut to the same length, so it serves the next request exactly (it recomputes the one or two
tokens the cache never saw). A cache that cannot be trimmed (a rotating cache past its window) is not
stored at all rather than stored wrong. Runs once per request.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _prompt_cache, _reproduce
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="prompt-cache-key-overrun",
    summary="server stores a speculative request's prompt cache under one token more than the cache holds",
    distribution="mlx-lm",
    affected=">=0.28.4,<=0.32.2",
    checked_through="0.32.2",
    catalogue="N8b (the 0.32.2 server's speculative prompt-cache key)",
    reference="not reported upstream",
    expiry=Expiry(
        "retire when the server files prompt caches under the tokens they hold (or speculative decoding "
        "processes its last token)",
        review_by=_dt.date(2027, 3, 1),
    ),
)


def held_tokens(prompt_cache: Any) -> int | None:
    """Tokens every layer of ``prompt_cache`` holds: the smallest integer ``offset``, or None if no layer has one."""
    offsets = [c.offset for c in prompt_cache if isinstance(getattr(c, "offset", None), int)]
    return min(offsets) if offsets else None


def _build_insert(original: Any) -> Any:
    from mlx_lm.models.cache import can_trim_prompt_cache

    def insert_cache(self: Any, model: Any, tokens: Any, prompt_cache: Any, *args: Any, **kwargs: Any) -> Any:
        held = held_tokens(prompt_cache)
        if held is not None and held < len(tokens):
            if not can_trim_prompt_cache(prompt_cache):
                return None  # cannot be made to match its key: not cached (a wrong entry is worse)
            for c in prompt_cache:
                extra = c.offset - held if isinstance(getattr(c, "offset", None), int) else 0
                if extra > 0:
                    c.trim(extra)
            tokens = tokens[:held]
        return original(self, model, tokens, prompt_cache, *args, **kwargs)

    return insert_cache


_prompt_cache.replace_method(PATCH, "insert_cache", _build_insert)


@PATCH.reproduce
def reproduce() -> Finding:
    """Do what the server does for a request with a draft model (speculative generation on main + draft
    caches, key = prompt + generated tokens, insert), then look the entry up for the key plus one token:
    the cache and the remainder must cover that prompt exactly."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.models.cache import make_prompt_cache

    main, draft = (_reproduce.tiny_llama(heads=2, kv_heads=1, vocab=128, doubled=True, noise=n) for n in (0, 0.05))
    prompt = [5, 9, 2, 33, 17, 21, 8]
    cache = make_prompt_cache(main) + make_prompt_cache(draft)
    key = prompt[:]
    for token, _, _ in speculative_generate_step(
        mx.array(prompt), main, draft, num_draft_tokens=3, max_tokens=8, prompt_cache=cache
    ):
        key.append(int(token))
    lru = _prompt_cache.prompt_cache_class()()
    lru.insert_cache("model", key[:], cache)
    found, rest = lru.fetch_nearest_cache("model", [*key, 40])
    if found is None:
        return Finding(False, f"{len(key)}-token key: the entry was not stored (nothing wrong served)")
    covered = found[0].offset + len(rest)
    detail = f"key {len(key)} tokens, main cache {found[0].offset}, draft cache {found[len(main.layers)].offset}"
    if covered != len(key) + 1:
        return Finding(True, f"{detail}: cache + remainder cover {covered} of the next prompt's {len(key) + 1} tokens")
    return Finding(False, f"{detail}: cache + remainder cover the next prompt exactly")
