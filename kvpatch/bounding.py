"""A bounded prompt cache per call, as mlx-lm's ``BatchGenerator._make_new_cache`` bounds it (0.31.2, 0.31.3): every
full-attention ``KVCache`` becomes a ``RotatingKVCache(max_size=max_kv_size)``, without changing
``make_prompt_cache`` for the whole process (the opt-in ``max-kv-size-ignored`` does that). Unlike it, a
``CacheList``'s ``KVCache`` children are bounded too, and ``keep`` is 0 for a model without ``make_cache``. Any
other cache (rotating, arrays, chunked, quantized, ``KVCache`` subclasses) stays as it is."""

from __future__ import annotations

import importlib
import sys
from typing import Any

__all__ = ["bound_layout", "bounded_prompt_cache"]


def bounded_prompt_cache(model: Any, max_kv_size: int | None, keep: int = 0) -> list[Any]:
    """The model's prompt cache with every full-attention ``KVCache`` a ``RotatingKVCache`` that never evicts its
    first ``keep`` positions; ``max_kv_size=None``: the model's own cache unchanged."""
    if max_kv_size is not None:
        _check(max_kv_size, keep)
    elif not _is_int(keep):
        raise TypeError(f"keep must be an int, not {type(keep).__name__}")
    from mlx_lm.models.cache import make_prompt_cache

    caches = list(make_prompt_cache(model))  # without max_kv_size: the model's own layout, whoever patched it
    return caches if max_kv_size is None else bound_layout(caches, max_kv_size, keep)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(max_kv_size: int, keep: int) -> None:
    """The arguments' types and ranges, checked at the call (a bad one would fail later, inside the model)."""
    for name, value in (("max_kv_size", max_kv_size), ("keep", keep)):
        if not _is_int(value):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if max_kv_size <= 0:
        raise ValueError(f"max_kv_size must be positive, got {max_kv_size}")
    if keep < 0 or keep >= max_kv_size:
        raise ValueError(f"keep must be >= 0 and smaller than max_kv_size, got keep={keep}")


def bound_layout(caches: list[Any], max_kv_size: int, keep: int = 0) -> list[Any]:
    """:func:`bounded_prompt_cache` for a layout of empty caches the caller has just built (CacheList layers are
    bounded in place); a populated cache is refused."""
    _check(max_kv_size, keep)
    # KVCache class -> the RotatingKVCache of the same origin (mlx-vlm's only where mlx-vlm is loaded already)
    origins: list[Any] = [importlib.import_module("mlx_lm.models.cache"), sys.modules.get("mlx_vlm.models.cache")]
    rotating = {m.KVCache: m.RotatingKVCache for m in origins if hasattr(m, "RotatingKVCache")}

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
