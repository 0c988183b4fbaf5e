"""Tiny local models for the serving tests: random weights and a tokenizer built here, no hub.

``write_lm_model(path, kind)`` writes an mlx-lm model directory (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` with a chat template) that ``mlx_lm.load`` / ``mlx_lm.server``
and ``mlx_vlm.load`` / ``mlx_vlm.server`` open with ``HF_HUB_OFFLINE=1``. The tokenizer is a word-level one
made with the ``tokenizers`` library over :data:`WORDS`, so prompts written with those words tokenize the
same everywhere. Weights come from the upstream model classes themselves (seeded), saved under their own
parameter names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WORDS = (
    "the a of and to in is it that was he for on are as with his they at be this from have or by one had "
    "not but what all were when we there can an your which their said if do will each about how up out them "
    "then she many some so these would other into has more her two like him see time could no make than "
    "first been its who now people my made over did down only way find use may water long little very after "
    "words called just where most know get through back much before go good new write our used me man too "
    "any day same right look think also around another came come work three word must because does part"
).split()
SPECIAL = ("<unk>", "<s>", "</s>", "<pad>")
VOCAB = 256  # the models' vocabulary; every id is a token of the tokenizer (fillers "x0".. after the words)
TOKENS = (*SPECIAL, *WORDS, "user", "assistant", "system")
TOKENS = TOKENS + tuple(f"x{i}" for i in range(VOCAB - len(TOKENS)))

SCALE = 4.0

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<s> ' + message['role'] + ' ' + message['content'] + ' ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s> assistant ' }}{% endif %}"
)

#: Model kinds: (mlx-lm model_type, config). Hidden 64, small head counts: tiny and fast on CPU.
KINDS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    # Hybrid: LFM2's short convolutions (ArraysCache state) with one attention layer.
    "lfm2": {
        "model_type": "lfm2",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "block_ff_dim": 128,
        "full_attn_idxs": [1],
        "rope_theta": 1000000.0,  # a required field before mlx-lm 0.31 (later releases default it)
    },
    # Sliding window: cohere2's first layer keeps an 8-token window (RotatingKVCache), the second is global.
    "cohere2": {
        "model_type": "cohere2",
        "hidden_size": 64,
        "head_dim": 32,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": VOCAB,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
    },
    # NoPE layers: SmolLM3 leaves RoPE out of every 4th layer (no_rope_layers[i] == 0): those layers never
    # read the cache offset, which is where offset-detach's lazy chain grows.
    "smollm3": {
        "model_type": "smollm3",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,  # a small KV cache (0.5 KB per token and row), so other growth shows
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "no_rope_layer_interval": 4,
    },
}


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(TOKENS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"})
    )


def write_lm_model(path: Path, kind: str = "llama", *, dtype: str = "float32", seed: int = 0, **overrides: Any) -> Path:
    """An mlx-lm model directory with random weights (``kind`` in :data:`KINDS`)."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    config = {**KINDS[kind], **overrides}
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    args = arch.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model = arch.Model(args)
    # Default initialisation gives flat logits (the model repeats one token); larger weights make the next
    # token depend on the context, so a wrong cache shows in the text.
    model.update(tree_map(lambda w: w * SCALE if w.ndim == 2 else w, model.parameters()))
    model.set_dtype(getattr(mx, dtype))
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"})
    meta = {"torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    (path / "config.json").write_text(json.dumps({**config, **meta}, indent=1))
    write_tokenizer(path)
    return path


def prompt(*words: str) -> str:
    """A prompt of vocabulary words (each maps to one token)."""
    unknown = [w for w in words if w not in WORDS]
    if unknown:
        raise ValueError(f"not in the tiny vocabulary: {unknown}")
    return " ".join(words)
