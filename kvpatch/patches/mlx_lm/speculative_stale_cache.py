"""speculative-stale-cache (catalogue E1): speculative decoding leaves stale caches in the caller's prompt cache.

Broken: ``speculative_generate_step`` (``mlx_lm.utils`` in 0.21.x–0.22.x, ``mlx_lm.generate`` by 0.23.2) splits
the caller's ``prompt_cache`` into ``prompt_cache[:n_layers]`` (main model) and ``prompt_cache[n_layers:]``
(draft model). Slicing a list makes new lists, so when kv-bits quantization swaps a ``KVCache`` for its
``QuantizedKVCache`` (``maybe_quantize_kv_cache`` assigns ``cache[i] = c.to_quantized(...)``) only the slices
see the new cache. The caller's list keeps the old ``KVCache`` objects, frozen at the offset where
quantization started. Measured with two tiny llamas (9-token prompt, ``kv_bits=8``, ``prefill_step_size=4``,
12 generated tokens): every entry of the caller's list is still a ``KVCache`` at offset 4 instead of a
``QuantizedKVCache`` at offset 20; continuing the chat from that list silently drops all but 4 tokens of
context (the next answer differs from the uninterrupted one from its first token). Plain ``generate_step``
is not affected (it never slices). Measured on every matrix release 0.22.0–0.32.2 and on 0.21.0 and 0.21.5
(0.21.0 is the first release with speculative decoding; 0.20.6 has none): the catalogue's "<= 0.32.2 from
0.22.0" extends down to 0.21.0. Not fixed upstream (not reported upstream).

Fix: a delta in front of the original. When the caller passes a plain ``list``, the original receives a
list subclass holding the same caches whose slices are linked copies: assigning an item of a slice (what kv
quantization does) also assigns the same position of the caller's list. Everything else (iteration,
indexing, ``len``) is plain ``list`` behaviour, so the model and the trim/quantize helpers see the same cache
objects as before; only the caller's list is now kept in step, at the moment a cache is replaced. Without a
caller cache (``prompt_cache=None``) or with a non-list sequence, the original runs untouched. Cold path:
the replacement runs once per generation; the only per-step cost is a Python-level ``__getitem__`` for
``cache[0]`` lookups in the model (measured 0.52 µs against 0.09 µs for a list, per lookup; 200 speculative
tokens on the tiny models took 4.55 s patched and 4.57 s unpatched).
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _reproduce
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="speculative-stale-cache",
    summary="speculative decoding quantizes only slices of the caller's prompt cache: the caller keeps stale caches",
    distribution="mlx-lm",
    affected=">=0.21.0,<=0.32.2",
    checked_through="0.32.2",
    reference="not reported upstream",
    catalogue="E1",
    expiry=Expiry(
        "retire when upstream's speculative_generate_step updates the caller's prompt cache in place",
        review_by=_dt.date(2027, 3, 1),
    ),
)


class _LinkedCacheList(list):
    """A list of caches whose item assignments also land in the caller's list.

    ``owner`` is the caller's list and ``start`` the position of this list's first item inside it. A slice
    with step 1 is again linked (at its own start), so ``cache[:n]`` / ``cache[n:]`` stay connected to the
    caller. Built without ``owner`` (e.g. by ``mlx.utils.tree_map`` calling ``type(tree)(...)``) it is a
    plain list.
    """

    __slots__ = ("_owner", "_start")

    def __init__(self, items: Any = (), owner: list | None = None, start: int = 0) -> None:
        super().__init__(items)
        self._owner = owner
        self._start = start

    def __getitem__(self, index: Any) -> Any:
        if self._owner is not None and isinstance(index, slice):
            first, _, step = index.indices(len(self))
            if step == 1:
                return _LinkedCacheList(list.__getitem__(self, index), self._owner, self._start + first)
        return list.__getitem__(self, index)

    def __setitem__(self, index: Any, value: Any) -> None:
        list.__setitem__(self, index, value)
        if self._owner is not None and isinstance(index, int):
            position = index + len(self) if index < 0 else index
            self._owner[self._start + position] = value


def _build(original: Any) -> Any:
    import functools
    import inspect

    parameter = inspect.signature(original).parameters.get("prompt_cache")
    if parameter is None or parameter.kind is not inspect.Parameter.KEYWORD_ONLY:
        raise TypeError("speculative_generate_step: prompt_cache is no longer a keyword-only parameter")

    @functools.wraps(original)
    def speculative_generate_step(*args: Any, **kwargs: Any) -> Any:
        prompt_cache = kwargs.get("prompt_cache")
        if type(prompt_cache) is list:
            kwargs["prompt_cache"] = _LinkedCacheList(prompt_cache, prompt_cache, 0)
        return original(*args, **kwargs)

    return speculative_generate_step


# 0.21.x-0.22.x define it in mlx_lm.utils (mlx_lm.generate is only the CLI there); by 0.23.2 it lives in
# mlx_lm.generate. Whichever module lacks it is skipped; stream_generate looks the name up in its own module.
PATCH.replace("mlx_lm.utils", "speculative_generate_step", optional=True)(_build)
PATCH.replace("mlx_lm.generate", "speculative_generate_step", optional=True)(_build)


def _speculative_step() -> Any:
    import importlib

    for name in ("mlx_lm.generate", "mlx_lm.utils"):
        module = importlib.import_module(name)
        step = getattr(module, "speculative_generate_step", None)
        if step is not None:
            return step
    raise LookupError("speculative_generate_step not found in mlx_lm.generate or mlx_lm.utils")


@PATCH.reproduce
def reproduce() -> Finding:
    """Speculative decoding with kv_bits on a caller's cache: is the caller's list live, and does a
    continued chat match an uninterrupted generation?"""
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    step = _speculative_step()
    main, draft = (_reproduce.tiny_llama(seed=s, heads=2, kv_heads=1, vocab=128, doubled=True) for s in (0, 1))
    options = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0, prefill_step_size=4, num_draft_tokens=2)

    def run(prompt: list[int], cache: list, n: int) -> list[int]:
        gen = step(mx.array(prompt), main, draft, prompt_cache=cache, max_tokens=n, **options)
        tokens = [int(item[0]) for item in gen]
        gen.close()
        return tokens

    mx.random.seed(3)
    first = mx.random.randint(0, 128, (9,)).tolist()
    second = mx.random.randint(0, 128, (5,)).tolist()
    cache = make_prompt_cache(main) + make_prompt_cache(draft)
    # The bug shows in values (the caller's cache list); an error here is something else: inconclusive.
    answer = run(first, cache, 12)
    expected = len(first) + len(answer) - 1  # the last answer token is not in the cache yet
    kinds = sorted({type(c).__name__ for c in cache})
    offsets = sorted({c.offset for c in cache})
    # Continue the chat from the caller's list, and compare with one uninterrupted generation.
    follow = run(answer[-1:] + second, cache, 8)
    reference = run(first + answer + second, make_prompt_cache(main) + make_prompt_cache(draft), 8)
    problems = []
    if kinds != [QuantizedKVCache.__name__] or offsets != [expected]:
        problems.append(
            f"the caller's cache holds {kinds} at offsets {offsets}, expected QuantizedKVCache at {expected}"
        )
    if follow != reference:
        problems.append(f"continued chat gives {follow}, uninterrupted generation {reference}")
    if problems:
        return Finding(True, "; ".join(problems))
    return Finding(
        False, f"caller's cache live (QuantizedKVCache at {expected}); continued chat == uninterrupted {follow}"
    )
