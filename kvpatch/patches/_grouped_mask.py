"""The delta and reproduction of gemma2-batch-mask and its mlx-vlm twin: an attention that groups its queries in five
dimensions (``(B, kv_heads, repeats, L, head_dim)``) and applies the mask it is given as it comes gets a
four-dimensional mask with a unit axis for the repeats, so that a batch's per-row ``(B, 1, L, S)`` mask broadcasts row
by row."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpatch.patches import _reproduce
from kvpatch.patches._numbers import judge, worst
from kvpatch.record import Finding, symptom

#: The tiny gemma2 both units' reproductions and tests build (mlx-lm's ``ModelArgs`` and mlx-vlm's ``ModelConfig``
#: take the same fields): hidden 64, 2 layers, 4 query heads over 2 KV heads of 16, vocabulary 64.
TINY_GEMMA2: dict[str, Any] = {
    "model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "head_dim": 16, "rms_norm_eps": 1e-5, "vocab_size": 64, "num_key_value_heads": 2,
}  # fmt: skip


def build(original: Any) -> Any:
    """``Attention.__call__(self, x, mask=None, cache=None)`` that hands ``original`` a four-dimensional mask array
    as ``(B, 1, 1, L, S)`` when the layer groups its queries (``repeats > 1``); anything else as it is. Hot path (per
    layer per step): one shape test and an ``expand_dims`` view, no host synchronisation."""
    import mlx.core as mx

    def __call__(self: Any, x: Any, mask: Any = None, cache: Any = None) -> Any:
        if self.repeats > 1 and getattr(mask, "ndim", 0) == 4:
            mask = mx.expand_dims(mask, 2)
        return original(self, x, mask, cache)

    return __call__


def reproduce(model: Callable[[], Any], caches: str, name: str) -> Finding:
    """The finding of :func:`_reproduce.model_rows_vs_alone` over two prompts (5 and 2 tokens, two decode steps): the
    bug's own ValueError (``broadcast_shapes``), or each prompt's logits batched against alone. ``caches``: the cache
    module's name (mlx-lm's or mlx-vlm's)."""
    import importlib

    try:
        rows = _reproduce.model_rows_vs_alone(model(), importlib.import_module(caches), (5, 2), 2)
    except ValueError as exc:
        text = symptom(exc, "broadcast_shapes").splitlines()[0]
        return Finding(True, f"{name} over a batch's per-row mask raises ValueError: {text}")
    return judge(
        worst(rows), "batched prompts' logits differ from each alone", "batched prompts' logits equal each alone"
    )
