"""What reproductions share beyond the fixes: the test models, the finding for an upstream that lacks what a
reproduction exercises, left-padded attention, a batch's rows against each row alone and mlx-vlm's quantized
attentions. How numbers are compared is :mod:`kvpatch.patches._numbers`.

Reproductions run at run time (``kvpatch verify``, ``status --verify``, a background verification), so
what they need lives here, among the units, and never in kvpatch's test helpers (``kvpatch.testing``
re-exports it for the tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpatch.patches._numbers import Difference, difference, worst
from kvpatch.record import DISTRIBUTIONS, Finding, symptom


def upstream_missing(exc: ImportError) -> bool:
    """True when ``exc`` is about mlx-lm / mlx-vlm, not a missing third-party dependency (that is no absent bug)."""
    return (getattr(exc, "name", None) or "").split(".")[0] in DISTRIBUTIONS.values()


def tiny_pixtral_language_model(*, head_dim: int, heads: int = 4, kv_heads: int = 2, dtype: object = None) -> object:
    """A random-weight mlx-vlm language model (pixtral's, hidden 64, 2 layers): the mlx-vlm test model."""
    import mlx.core as mx
    from mlx_vlm.models.pixtral.config import TextConfig
    from mlx_vlm.models.pixtral.language import LanguageModel

    mx.random.seed(0)
    config = TextConfig(
        model_type="mistral",
        hidden_size=64,
        head_dim=head_dim,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=64,
        rope_theta=10000.0,
    )
    model = LanguageModel(config)
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def seeded(cls: Callable[..., Any], *args: Any) -> Any:
    """``cls(*args)`` with random weights from seed 0, evaluated: a tiny test model or layer."""
    import mlx.core as mx

    mx.random.seed(0)
    module = cls(*args)
    mx.eval(module.parameters())
    return module


def left_padded(prompts: list[Any]) -> tuple[list[int], Any]:
    """Each row's left padding, and the batch of ``prompts`` (``(1, n, ...)`` each) left-padded to the longest."""
    import mlx.core as mx

    longest = max(p.shape[1] for p in prompts)
    padding = [longest - p.shape[1] for p in prompts]
    rest = [(0, 0)] * (prompts[0].ndim - 2)
    return padding, mx.concatenate([mx.pad(p, [(0, 0), (n, 0), *rest]) for p, n in zip(prompts, padding, strict=True)])


def row_differences(batched: list[Any], alone: list[list[Any]]) -> list[Difference]:
    """Per row, the largest difference (:func:`~kvpatch.patches._numbers.difference`, the worst over the steps) between
    its output in the batch (``batched[step][row]``) and alone (``alone[row][step][0]``)."""
    rows = [
        worst(
            difference(out[row], own[0], where=f"row {row}, step {step}")
            for step, (out, own) in enumerate(zip(batched, steps, strict=True))
        )
        for row, steps in enumerate(alone)
    ]
    return [d for d in rows if d is not None]


def model_rows_vs_alone(model: Any, caches: Any, lengths: tuple[int, ...], steps: int) -> list[Difference]:
    """Each prompt of a left-padded batch (``caches.BatchKVCache`` per layer, the masks the model makes itself)
    against the prompt alone (``caches.KVCache``): per row, the largest difference of the last position's logits over
    prefill and ``steps`` decode steps of the same tokens (a vocabulary of at least 64). ``model``: a tiny
    random-weight model (its ``layers``); ``caches``: the cache module (mlx-lm's or mlx-vlm's)."""
    import mlx.core as mx

    def logits(inputs: Any, cache: list[Any]) -> Any:
        out = model(inputs, cache=cache)
        return getattr(out, "logits", out)[:, -1]

    vocab = 64
    prompts = [mx.random.randint(1, vocab, (1, n), key=mx.random.key(i)) for i, n in enumerate(lengths)]
    tokens = mx.random.randint(1, vocab, (steps, len(lengths), 1), key=mx.random.key(len(lengths)))
    alone = []
    for row, prompt in enumerate(prompts):
        cache = [caches.KVCache() for _ in model.layers]
        alone.append([logits(prompt, cache)] + [logits(tokens[s, row : row + 1], cache) for s in range(steps)])
    padding, batch = left_padded(prompts)
    cache = [caches.BatchKVCache(padding) for _ in model.layers]
    outs = [logits(batch, cache)] + [logits(tokens[s], cache) for s in range(steps)]
    return row_differences(outs, alone)


def tiny_llama(
    *,
    seed: int = 0,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 64,
    dtype: object = None,
    doubled: bool = False,
    noise: float = 0.0,
) -> Any:
    """A random-weight mlx-lm llama (hidden 64, 2 layers): the mlx-lm test model. No downloads.

    ``doubled`` doubles every weight: the default init is so flat that greedy decoding repeats one token whatever
    the context, which generation reproductions cannot tell apart from a correct run. ``noise`` then adds that
    fraction of each weight's mean magnitude as noise (seeded ``seed + 1``): a draft model that agrees with the
    noiseless one on some tokens and not on others (one from another seed agrees on none).
    """
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models import llama

    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        rope_theta=10000.0,
    )
    model = llama.Model(args)
    if doubled:
        model.update(tree_map(lambda p: p * 2, model.parameters()))
    if noise:
        mx.random.seed(seed + 1)
        model.update(tree_map(lambda p: p + noise * mx.abs(p).mean() * mx.random.normal(p.shape), model.parameters()))
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def absent(exc: ImportError, what: str) -> Finding:
    """The finding where the running upstream lacks what a reproduction exercises (``what``: "this mlx-vlm has
    no X"); an ImportError from anything else is raised."""
    if not upstream_missing(exc):
        raise exc
    return Finding(False, f"{what}: nothing to fix")


def rows_vs_alone(
    build: Callable[[], Any], compare: Callable[[Any], list[Difference]], name: str, missing: str
) -> Finding | list[Difference]:
    """``compare(build())``: a left-padded batch's per-row differences from each row alone; or the finding where
    this upstream lacks the model (``missing``), or where ``name`` raises on the batch cache's per-row (array)
    offset (positions from ``mx.arange``)."""
    try:
        module = build()
    except ImportError as exc:
        return absent(exc, missing)
    try:
        return compare(module)
    except TypeError as exc:
        text = symptom(exc, "arange(): incompatible").splitlines()[0]
        return Finding(True, f"{name} with a batch cache (array offset) raises TypeError: {text}")


def left_padded_attention(queries: Any, keys: Any, values: Any, left_padding: Any, scale: float) -> Any:
    """Attention with each row's first ``left_padding`` key slots masked: how a batch decode step attends."""
    import mlx.core as mx

    mask = mx.arange(keys.shape[-2])[None, None, None, :] >= left_padding[:, None, None, None]
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def vlm_quantized_attentions() -> list[tuple[str, Any]]:
    """mlx-vlm's own modules with a quantized attention (``quantized_scaled_dot_product_attention``): (name,
    module) for each."""
    import importlib

    found = []
    for name in ("mlx_vlm.models.base", "mlx_vlm.models.text_models.base"):
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            if not upstream_missing(exc):
                raise
            continue
        if hasattr(module, "quantized_scaled_dot_product_attention"):
            found.append((name, module))
    return found


def on_turboquant_metal(measure: Callable[[], Finding], kernel: str, path: str) -> Finding:
    """``measure()`` where mlx-vlm's TurboQuant Metal kernels can run; elsewhere a skip: the ``kernel`` runs only on
    an Apple GPU, so this backend always takes the correct ``path``."""
    from mlx_vlm import turboquant

    if not turboquant._metal_available():
        return Finding(
            False,
            "not measured",
            skipped=f"Metal-only bug: {kernel} only on an Apple GPU (mlx reports no Metal device here), so this "
            f"backend always takes the correct {path}",
        )
    return measure()
