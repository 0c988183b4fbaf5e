"""max-kv-size-ignored (catalogue H5): ``max_kv_size`` is ignored for every model that builds its own cache.

Broken: ``mlx_lm.models.cache.make_prompt_cache(model, max_kv_size)`` returns ``model.make_cache()`` as is
when the model defines ``make_cache``, so the full-attention layers get an unbounded ``KVCache`` instead of
the ``RotatingKVCache(max_size=max_kv_size, keep=4)`` that models without ``make_cache`` get. ``generate_step
(max_kv_size=...)`` (and ``generate``/``stream_generate``, the CLI's ``--max-kv-size``) builds its cache
through it, so memory grows without bound. llama defines ``make_cache`` from 0.28.1, which made this hit
the most common architecture; cohere2 (from 0.20.5) and gemma3_text (from 0.22.0) have it for their global
layers in every release. Measured with a tiny cohere2 (one sliding layer, window 8; one global layer),
``max_kv_size=16``, 24-token prompt: the global layer is a ``KVCache`` holding all 27 positions. The
batch generator has the same hole in its own helper ``mlx_lm.generate._make_cache(model, left_padding,
max_kv_size)`` (0.30.x up to 0.31.1: ``BatchKVCache`` instead of ``BatchRotatingKVCache`` for make_cache
models); 0.31.2–0.31.3 bound it in ``BatchGenerator._make_new_cache``, and 0.32.x call
``make_prompt_cache(model, max_kv_size)`` again. The catalogue gives 0.28.1–0.32.2 (llama); measured here
0.20.5–0.32.2 with cohere2 (0.20.4 and older have no model whose ``make_cache`` returns a ``KVCache``).
Not fixed upstream (upstream's docstring describes the behaviour, so this patch is opt-in:
``KVPATCH_ENABLE=max-kv-size-ignored``). Proposed upstream by ml-explore/mlx-lm#1343 (replace the plain
``KVCache`` entries of ``make_cache()`` with a bounded cache) and #1526 (forward ``max_kv_size`` to a
``make_cache`` that accepts it), both closed unmerged.

Fix: deltas after the originals. When ``max_kv_size`` is given and the model defines ``make_cache``, each
entry of the model's own layout whose type is exactly ``KVCache`` (``BatchKVCache`` in ``_make_cache``)
is replaced by the bounded cache upstream uses for models without ``make_cache``
(``RotatingKVCache(max_size=max_kv_size, keep=4)``, ``BatchRotatingKVCache(max_kv_size, left_padding)``).
Everything else the model chose stays: sliding-window ``RotatingKVCache``s, ``ArraysCache``/Mamba state,
``ChunkedKVCache`` and other ``KVCache`` subclasses, and composite ``CacheList`` layers (whose sub-caches
may have to stay aligned). Without ``max_kv_size`` nothing changes. ``mlx_lm.generate`` imports
``make_prompt_cache`` by name from 0.32.0; the engine rebinds such names, and a later ``from ... import``
sees the replacement. Cold path: called once per generation.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="max-kv-size-ignored",
    summary="make_prompt_cache ignores max_kv_size for models with make_cache: unbounded KVCache",
    distribution="mlx-lm",
    affected=">=0.20.5,<=0.32.2",
    checked_through="0.32.2",
    reference="ml-explore/mlx-lm#1343, ml-explore/mlx-lm#1526 (both closed unmerged)",
    catalogue="H5",
    # Upstream documents the behaviour ("the model's own make_cache wins"), and servers probe it: bounding
    # the cache is a policy change, not a bug fix, so it is off unless KVPATCH_ENABLE names it.
    opt_in=True,
    expiry=Expiry(
        "retire when upstream's make_prompt_cache bounds full-attention layers of make_cache models",
        review_by=_dt.date(2027, 3, 1),
    ),
)


@PATCH.replace("mlx_lm.models.cache", "make_prompt_cache")
def _build_make_prompt_cache(original: Any) -> Any:
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    def make_prompt_cache(model: Any, max_kv_size: int | None = None) -> Any:
        caches = original(model, max_kv_size)
        if max_kv_size is None or not hasattr(model, "make_cache"):
            return caches
        return [RotatingKVCache(max_size=max_kv_size, keep=4) if type(c) is KVCache else c for c in caches]

    return make_prompt_cache


@PATCH.replace("mlx_lm.generate", "_make_cache", optional=True)
def _build_batch_make_cache(original: Any) -> Any:
    import inspect

    if "max_kv_size" not in inspect.signature(original).parameters:
        # 0.28.x–0.30.4: the batch generator takes no max_kv_size at all; nothing to honour.
        return original
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

    def _make_cache(model: Any, left_padding: Any, max_kv_size: int | None) -> Any:
        caches = original(model, left_padding, max_kv_size)
        if max_kv_size is None or not hasattr(model, "make_cache"):
            return caches
        return [BatchRotatingKVCache(max_kv_size, left_padding) if type(c) is BatchKVCache else c for c in caches]

    return _make_cache


def _tiny_cohere2(window: int = 8) -> Any:
    """Layer 0 sliding (RotatingKVCache of ``window``), layer 1 global (an unbounded KVCache upstream)."""
    import mlx.core as mx
    from mlx_lm.models import cohere2

    mx.random.seed(0)
    args = cohere2.ModelArgs(
        model_type="cohere2",
        hidden_size=64,
        head_dim=32,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128,
        sliding_window=window,
        sliding_window_pattern=2,
    )
    model = cohere2.Model(args)
    mx.eval(model.parameters())
    return model


def _layout(caches: Any) -> list[tuple[str, Any]]:
    return [(type(c).__name__, getattr(c, "max_size", None)) for c in caches]


@PATCH.reproduce
def reproduce() -> Finding:
    """make_prompt_cache(model, 16) and generate_step(max_kv_size=16) on a model with its own make_cache."""
    import importlib

    import mlx.core as mx
    from mlx_lm.models import cache as cache_module

    model = _tiny_cohere2()
    expected = [("RotatingKVCache", 8), ("RotatingKVCache", 16)]
    problems = []
    layout = _layout(cache_module.make_prompt_cache(model, 16))
    if layout != expected:
        problems.append(f"make_prompt_cache(model, 16) gives {layout}, expected {expected}")

    # generate_step builds its cache from make_prompt_cache: record what the model is called with.
    used = []
    original_call = type(model).__call__

    class Recording(type(model)):  # type: ignore[misc]  # the tiny model's class, known at run time
        def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            used.append(kwargs["cache"] if "cache" in kwargs else args[0])
            return original_call(self, inputs, *args, **kwargs)

    model.__class__ = Recording
    generate = importlib.import_module("mlx_lm.generate")
    step = getattr(generate, "generate_step", None) or importlib.import_module("mlx_lm.utils").generate_step
    mx.random.seed(1)
    prompt = mx.random.randint(0, 128, (24,))
    for _ in step(prompt, model, max_kv_size=16, max_tokens=4):
        pass
    final = used[-1]
    kept = [min(c.keys.shape[2], c.offset) if c.keys is not None else 0 for c in final]  # KVCache allocates ahead
    if _layout(final) != expected or kept[1] > 16:
        problems.append(
            f"generate_step(max_kv_size=16) decodes with {_layout(final)}; the global layer holds {kept[1]} positions "
            f"after {final[1].offset} tokens"
        )
    if problems:
        return Finding(True, "; ".join(problems))
    return Finding(False, f"global layer bounded: {layout}; generate_step keeps {kept[1]} of {final[1].offset}")
