"""Tiny random mlx-vlm language models through mlx-vlm's own batch caches against each row alone (a probe, run by
hand inside a bucket).

For each model: two prompts of different lengths, each prefilled and decoded alone with the model's single-row
caches, then together as one left-padded batch with the batch caches ``_make_cache`` builds (per-row ``offset``
arrays; ``BatchRotatingKVCache`` for sliding-window layers), the batch optionally prefilled in chunks; it prints the
largest difference of the last position's logits per row and step (prefill, then each decode step)::

    KVPATCH=off .venv/bin/python scripts/in_bucket.py vlm-0.7.10 -- python -P scripts/probe_batch_models.py gemma4 \
        --lengths 3,30 --chunk 7 --window 8

Models: ``gemma4`` (sliding window ``--window``), ``qwen3_5``, ``glm4v_moe``. Gemma 4 prints zeros on 0.5.0, 0.6.4
and 0.7.10 (its masks are built per layer type from that type's cache, so a sliding layer's mask is as long as its
keys, also when a chunk is longer than the window). ``qwen3_5`` prints non-zero decode
differences for the padded row when given neither ``position_ids`` nor a 2-D attention mask (upstream's contract:
its prompt positions then count the pads); ``glm4v_moe`` prints zeros with kvpatch on (``glm4v-batch-positions``)
and non-zero differences with ``KVPATCH_DISABLE=glm4v-batch-positions``.
"""

from __future__ import annotations

import argparse
import importlib
from types import SimpleNamespace
from typing import Any

import mlx.core as mx

#: What the mRoPE models' ``get_rope_index`` reads from the full model config (no image in these prompts).
VISION = SimpleNamespace(
    vision_config=SimpleNamespace(spatial_merge_size=2), image_token_id=61, video_token_id=62, vision_start_token_id=63
)


def tiny(name: str, window: int) -> Any:
    """A tiny random language model of mlx-vlm's ``name`` (hidden 64, 4 heads, 2 KV heads of 16, vocabulary 64)."""
    config = importlib.import_module(f"mlx_vlm.models.{name}.config").TextConfig
    language = importlib.import_module(f"mlx_vlm.models.{name}.language")
    if name == "qwen3_5":
        from kvpatch.patches.mlx_vlm.qwen35_batch_positions import tiny_config

        return language.LanguageModel(tiny_config(), VISION)
    if name == "gemma4":
        text = config(
            hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4, head_dim=16,
            global_head_dim=16, vocab_size=64, vocab_size_per_layer_input=64, num_key_value_heads=2,
            num_kv_shared_layers=0, hidden_size_per_layer_input=8, sliding_window=window, sliding_window_pattern=2,
            max_position_embeddings=512,
        )  # fmt: skip
        return language.LanguageModel(text)
    from kvpatch.patches.mlx_vlm.glm4v_batch_positions import tiny_config

    return language.LanguageModel(tiny_config(), VISION)


def batch_caches(model: Any, padding: list[int]) -> Any:
    """The batch caches mlx-vlm's batch generator builds (``_make_cache``, which moved between releases)."""
    for name in ("mlx_vlm.generate.ar", "mlx_vlm.generate"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "_make_cache"):
            return module._make_cache(model, padding)
    raise RuntimeError("this mlx-vlm has no _make_cache")


def probe(name: str, lengths: list[int], chunk: int, window: int, steps: int) -> list[list[float]]:
    from mlx_vlm.models.cache import KVCache

    mx.random.seed(0)
    model = tiny(name, window)
    mx.eval(model.parameters())
    prompts = [mx.random.randint(1, 60, (n,)).tolist() for n in lengths]
    decode = mx.random.randint(1, 60, (steps, len(lengths))).tolist()

    def fresh() -> None:  # the mRoPE models keep the last prompt's positions on the model
        for attribute in ("_position_ids", "_rope_deltas"):
            if hasattr(model, attribute):
                setattr(model, attribute, None)

    alone = []
    for row, prompt in enumerate(prompts):
        fresh()
        cache = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.model.layers]
        outs = [model(mx.array([prompt]), cache=cache).logits[0, -1]]
        outs += [model(mx.array([[step[row]]]), cache=cache).logits[0, -1] for step in decode]
        alone.append(outs)
    longest = max(lengths)
    fresh()
    cache = batch_caches(model, [longest - n for n in lengths])
    batch = mx.array([[0] * (longest - len(p)) + p for p in prompts])
    for start in range(0, longest, chunk or longest):
        last = model(batch[:, start : start + (chunk or longest)], cache=cache).logits[:, -1]
    outs = [last] + [model(mx.array([[t] for t in step]), cache=cache).logits[:, -1] for step in decode]
    return [[float(mx.abs(outs[s][r] - alone[r][s]).max()) for s in range(steps + 1)] for r in range(len(lengths))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", help="comma-separated: gemma4, qwen3_5, glm4v_moe")
    parser.add_argument("--lengths", default="5,9", help="prompt lengths, comma-separated")
    parser.add_argument("--chunk", type=int, default=0, help="prefill the batch in chunks of this many tokens")
    parser.add_argument("--window", type=int, default=8, help="gemma4's sliding window")
    parser.add_argument("--steps", type=int, default=3, help="decode steps")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    for name in args.models.split(","):
        errors = probe(name, lengths, args.chunk, args.window, args.steps)
        rounded = [[round(e, 4) for e in row] for row in errors]
        print(f"{name}: max |batched - alone| per row, per step (prefill, decode...): {rounded}")


if __name__ == "__main__":
    main()
