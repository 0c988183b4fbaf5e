"""quantized-nbytes (catalogue H6): ``QuantizedKVCache.nbytes`` raises NameError (``tree_reduce`` not imported).

Broken: from 0.31.0 ``mlx_lm.models.cache.QuantizedKVCache.nbytes`` sums its packed arrays with
``tree_reduce``, which ``mlx_lm/models/cache.py`` never imports: every call raises ``NameError: name
'tree_reduce' is not defined``. The server's LRU prompt cache (``LRUPromptCache.insert_cache`` sums
``c.nbytes`` over the cache) and ``BatchGenerator.prompt_cache_nbytes`` fail as soon as a kv-bits cache is
stored or measured. Introduced by 83ff9c96 (#906); the catalogue gives 0.31.1–0.31.2, measured here
0.31.0–0.31.2 (0.31.0 ships the same code). 0.30.7 has no ``QuantizedKVCache.nbytes`` (AttributeError: a
missing feature, not this bug).

Upstream: ml-explore/mlx-lm#1165 (a4017309), released in 0.31.3, adds the import.

Fix: supply the missing module-level name: ``mlx_lm.models.cache.tree_reduce`` becomes
``mlx.utils.tree_reduce``, so upstream's own ``nbytes`` runs unchanged and returns the sum of the packed
keys' and values' ``nbytes`` (data, scales, biases), as in 0.31.3. Adding the name is safe: it is a plain
module global looked up only by that module's own functions; no capability check (``hasattr``) reads it,
and it is the same object a fixed release imports. Cold path (prompt-cache accounting).
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="quantized-nbytes",
    summary="QuantizedKVCache.nbytes raises NameError: tree_reduce is not imported in mlx_lm.models.cache",
    distribution="mlx-lm",
    affected=">=0.31.0,<0.31.3",
    fixed_in="0.31.3",
    fixed_commit="a4017309",
    introduced_commit="83ff9c96",
    reference="ml-explore/mlx-lm#1165",
    catalogue="H6",
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-lm < 0.31.3",
        review_by=_dt.date(2027, 6, 1),
    ),
)


@PATCH.add("mlx_lm.models.cache", "tree_reduce")
def _build(_: Any) -> Any:
    from mlx.utils import tree_reduce

    return tree_reduce


@PATCH.reproduce
def reproduce() -> Finding:
    """``nbytes`` of a filled QuantizedKVCache against the sum of its arrays' ``nbytes``."""
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache

    mx.random.seed(0)
    cache = QuantizedKVCache(group_size=32, bits=8)
    cache.update_and_fetch(mx.random.normal((1, 2, 5, 64)), mx.random.normal((1, 2, 5, 32)))
    expected = sum(x.nbytes for x in (*cache.keys, *cache.values))
    try:
        got = cache.nbytes
    except AttributeError as exc:
        if "nbytes" in str(exc):
            return Finding(False, "QuantizedKVCache has no nbytes in this release (not this bug)")
        raise  # not this bug: inconclusive
    except NameError as exc:  # the bug's own error: nbytes calls a tree_reduce the module never imported
        return Finding(True, f"QuantizedKVCache.nbytes raises NameError: {symptom(exc, 'tree_reduce')}")
    if got != expected:
        return Finding(True, f"QuantizedKVCache.nbytes = {got}, sum of its arrays' nbytes = {expected}")
    return Finding(False, f"QuantizedKVCache.nbytes = {got} == sum of its 6 arrays' nbytes")
