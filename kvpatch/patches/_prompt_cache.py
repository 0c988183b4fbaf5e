"""Shared by prompt-cache-exact-hit and prompt-cache-key-overrun: where the running mlx-lm keeps its
server prompt cache. Not a patch unit (units live in the distribution folders)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpatch.record import Patch


def replace_method(patch: Patch, method: str, build: Callable[[Any], Any]) -> None:
    """Declare ``patch``'s replacement of ``LRUPromptCache.<method>`` built by ``build(original)``, where the
    running mlx-lm defines the class: ``mlx_lm.models.cache`` from 0.31.2, ``mlx_lm.server`` before (where the
    server only re-exports the class, it is patched once, at its home)."""

    def in_server(original: Any) -> Any:
        if getattr(original, "__module__", None) != "mlx_lm.server":
            return original
        return build(original)

    patch.replace("mlx_lm.models.cache", f"LRUPromptCache.{method}", optional=True)(build)
    patch.replace("mlx_lm.server", f"LRUPromptCache.{method}", optional=True)(in_server)


def prompt_cache_class() -> Any:
    """``LRUPromptCache`` of the running mlx-lm (``mlx_lm.models.cache`` from 0.31.2, else the server's)."""
    from mlx_lm.models import cache

    found = getattr(cache, "LRUPromptCache", None)
    if found is None:
        import mlx_lm.server

        found = mlx_lm.server.LRUPromptCache
    return found
