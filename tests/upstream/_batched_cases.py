"""The model-level cases of patches found by the bug hunt (gemma2-batch-mask, vlm-gemma2-batch-mask,
vlm-mask-cache-list): a tiny random-weight model over left-padded batches of several shapes gives each prompt the
logits it has alone, prefill and two decode steps (``_reproduce.model_rows_vs_alone``). Prompts of one length get no
per-row mask: that case passes with or without the patch. The gemma2 twins also share the paths their patch leaves
to upstream."""

from __future__ import annotations

from typing import Any

from kvpatch.patches._grouped_mask import TINY_GEMMA2
from kvpatch.patches._reproduce import model_rows_vs_alone
from kvpatch.testing import with_and_without, worst

LENGTHS = [(5, 2), (3, 7, 4), (4, 4)]


def rows_agree(model: Any, caches: Any, lengths: tuple[int, ...]) -> None:
    found = worst(model_rows_vs_alone(model, caches, lengths, 2))
    assert found is not None and found.within, found


def gemma2_untouched_paths(patch_id: str, model: Any, caches: Any, attention: Any, config: Any, logits: Any) -> None:
    """A gemma2 patch (mlx-lm's or mlx-vlm's copy) leaves upstream's result alone where the mask needs no unit axis:
    a single prompt's forward pass (``logits`` takes the model's output to its logits), and a batch through a layer
    with one KV head per query head (``attention`` built from ``config``)."""
    import mlx.core as mx

    prompt = mx.array([[3, 9, 27, 17, 51]])
    mx.random.seed(1)
    ungrouped = attention(config(**{**TINY_GEMMA2, "num_hidden_layers": 1, "num_attention_heads": 2}))
    x = mx.random.normal((2, 3, 64), key=mx.random.key(2))

    def run() -> tuple[Any, Any]:
        single = logits(model(prompt, cache=[caches.KVCache() for _ in model.layers]))
        cache = caches.BatchKVCache([1, 0])
        batch = ungrouped(x, mask=cache.make_mask(3, return_array=True), cache=cache)
        return single.tolist(), batch.tolist()

    patched, unpatched = with_and_without(patch_id, run)
    assert patched == unpatched
