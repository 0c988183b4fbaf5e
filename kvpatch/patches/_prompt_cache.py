"""Shared by prompt-cache-exact-hit and prompt-cache-key-overrun: where the running mlx-lm keeps its
server prompt cache. Not a patch unit (units live in the distribution folders)."""

from __future__ import annotations

from typing import Any


def prompt_cache_class() -> Any:
    """``LRUPromptCache`` of the running mlx-lm (``mlx_lm.models.cache`` from 0.31.2, else the server's)."""
    from mlx_lm.models import cache

    found = getattr(cache, "LRUPromptCache", None)
    if found is None:
        import mlx_lm.server

        found = mlx_lm.server.LRUPromptCache
    return found
