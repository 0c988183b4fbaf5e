"""A bounded prompt cache built per call, the way mlx-lm's own batch generator bounds it.

``mlx_lm.models.cache.make_prompt_cache(model, max_kv_size)`` returns ``model.make_cache()`` unchanged
when the model defines one, so the full-attention layers of such models stay unbounded (kvpatch's opt-in
``max-kv-size-ignored`` changes that for the whole process). mlx-lm's ``BatchGenerator._make_new_cache``
(0.31.2, 0.31.3) bounds them itself: every ``KVCache`` of the model's layout becomes a
``RotatingKVCache(max_size=max_kv_size)`` (``keep=0``) and everything else stays as the model made it.
Servers build their caches per request and want exactly that, without flipping upstream's documented
behaviour for every caller in the process::

    cache = kvpatch.bounded_prompt_cache(model, 4096)

Differences from ``_make_new_cache``, both where it leaves a full-attention layer unbounded: a
``CacheList``'s ``KVCache`` children are bounded too (the architectures that nest are the ones that run
out of memory), and a model without ``make_cache`` gets ``keep=0`` rather than
``make_prompt_cache``'s ``keep=4`` (the batch caches have no ``keep``). Sliding-window
``RotatingKVCache``s, ``ArraysCache``/Mamba state, ``ChunkedKVCache``, quantized caches and any
``KVCache`` subclass are left as they are. Cold path: once per request.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__all__ = ["bound_layout", "bounded_prompt_cache"]

#: The modules whose ``KVCache`` is bounded with their own ``RotatingKVCache`` (both cache origins).
_ORIGINS = ("mlx_lm.models.cache", "mlx_vlm.models.cache")


def bounded_prompt_cache(model: Any, max_kv_size: int | None, keep: int = 0) -> list[Any]:
    """The model's prompt cache with every full-attention ``KVCache`` replaced by a ``RotatingKVCache``.

    ``max_kv_size=None`` returns the model's own cache unchanged (``make_prompt_cache(model)``).
    ``keep`` is the number of leading positions a rotating cache never evicts (0 as in mlx-lm's batch
    path; ``make_prompt_cache`` uses 4 for models without ``make_cache``).
    """
    _check(max_kv_size, keep)
    from mlx_lm.models.cache import make_prompt_cache

    caches = list(make_prompt_cache(model))  # without max_kv_size: the model's own layout, whoever patched it
    return caches if max_kv_size is None else bound_layout(caches, max_kv_size, keep)


def bound_layout(caches: list[Any], max_kv_size: int, keep: int = 0) -> list[Any]:
    """:func:`bounded_prompt_cache` for a layout the caller has just built (empty caches, nobody else holds
    them): a server whose code builds the model's cache itself bounds it with this. CacheList layers are
    bounded in place; a populated cache is never re-laid-out (its contents would have to become a ring)."""
    _check(max_kv_size, keep)
    rotating = {}  # KVCache class -> the RotatingKVCache of the same origin
    for name in _ORIGINS:
        module = sys.modules.get(name)
        if module is None and name == _ORIGINS[0]:
            module = importlib.import_module(name)
        if module is not None and hasattr(module, "KVCache") and hasattr(module, "RotatingKVCache"):
            rotating[module.KVCache] = module.RotatingKVCache

    def bound(cache: Any) -> Any:
        make = rotating.get(type(cache))
        if make is not None:
            if getattr(cache, "keys", None) is not None:
                raise ValueError("bound_layout() bounds freshly made caches only; this KVCache holds positions")
            return make(max_size=max_kv_size, keep=keep)
        children = getattr(cache, "caches", None)
        if isinstance(children, (list, tuple)) and children:
            cache.caches = type(children)(bound(c) for c in children)
        return cache

    return [bound(c) for c in caches]


def _check(max_kv_size: object, keep: int) -> None:
    if max_kv_size is not None and (isinstance(max_kv_size, bool) or not isinstance(max_kv_size, int)):
        raise TypeError(f"max_kv_size must be an int or None, not {type(max_kv_size).__name__}")
    if isinstance(max_kv_size, int) and max_kv_size <= 0:
        raise ValueError(f"max_kv_size must be positive, got {max_kv_size}")
    if keep < 0 or (isinstance(max_kv_size, int) and keep >= max_kv_size):
        raise ValueError(f"keep must be >= 0 and smaller than max_kv_size, got keep={keep}")
