"""vlm-mask-cache-list (catalogue issue 36, found by the bug hunt): mlx-vlm's ``create_attention_mask`` ignores a list
of caches, so language models that pass theirs get no padding mask in a batch.

Broken: ``mlx_vlm.models.base.create_attention_mask(h, cache)`` (mlx-vlm's own from 0.6.4) asks ``cache`` for its
mask only when it has ``make_mask``. About twenty language models hand it their whole list of per-layer caches
(``create_attention_mask(h, cache)``: idefics2, idefics3, llava_bunny, mllama, deepseek_vl_v2, ...); a list has no
``make_mask``, so a prompt pass gets ``"causal"`` and every decode step (one token) ``None``. With the batch caches of
mlx-vlm's batch generator, which calls the language model without a mask, a left-padded row attends to its padding
in prefill and in every decode step: its logits differ from the prompt alone. Found by kvpatch's bug hunt
(``logits-agree`` on vlm-0.5.0 and vlm-0.6.4) and measured with this unit's reproduction (a tiny idefics2, prompts of
5 and 2 tokens, two decode steps) on 0.6.4 and 0.7.8: the padded row differs by 2.4 and 2.8 without the patch, equal
with it. 0.5.0–0.6.3 re-export mlx-lm's function (the same symptom; not patched here: replacing it there would change
mlx-lm's own function for mlx-lm's models, which pass one cache). mlx-lm has the same bug in two models of its own
(ml-explore/mlx-lm#1906: minicpm3, phixtral).

Upstream: fixed in mlx-vlm 0.7.9, whose ``create_attention_mask`` takes a list's first cache.

Fix: a delta in front of the original, upstream's own: a list or tuple of caches becomes its first cache (None when
empty), which is the cache every attention layer of these models shares the offset and padding of; anything else
passes unchanged. Once per forward pass (not per layer): a plain function, one ``isinstance`` test.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _reproduce
from kvpatch.patches._numbers import judge, worst
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    # every field: CONTRIBUTING.md, "The record"
    id="vlm-mask-cache-list",
    summary=(
        "create_attention_mask ignores a list of caches: language models that pass theirs get no padding mask in a "
        "batch"
    ),
    distribution="mlx-vlm",
    affected=">=0.6.4,<0.7.9",
    fixed_in="0.7.9",
    reference=(
        "not reported upstream (found by kvpatch's bug hunt; fixed in mlx-vlm 0.7.9, whose create_attention_mask "
        "takes a cache list's first cache)"
    ),
    catalogue="issue 36 (found by the bug hunt)",
    hot_path=True,
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-vlm < 0.7.9",
        review_by=_dt.date(2027, 5, 30),
    ),
)


@PATCH.replace("mlx_vlm.models.base", "create_attention_mask")
def _build(original: Any) -> Any:
    def create_attention_mask(h: Any, cache: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(cache, (list, tuple)):
            cache = cache[0] if cache else None
        return original(h, cache, *args, **kwargs)

    return create_attention_mask


def tiny_model() -> Any:
    """A tiny random idefics2 ``LanguageModel`` (hidden 64, 2 layers, 4 query heads over 2 KV heads, vocabulary 64): an
    architecture that hands ``create_attention_mask`` its list of caches."""
    from mlx_vlm.models.idefics2.config import TextConfig
    from mlx_vlm.models.idefics2.language import LanguageModel

    config = TextConfig(
        model_type="idefics2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=256,
    )  # fmt: skip
    return _reproduce.seeded(LanguageModel, config)


@PATCH.reproduce
def reproduce() -> Finding:
    """A tiny idefics2 language model over a left-padded batch of two prompts, against each prompt alone."""
    from mlx_vlm.models import cache

    try:
        model = tiny_model()
    except ImportError as exc:
        return _reproduce.absent(exc, "this mlx-vlm has no idefics2 model")
    return judge(
        worst(_reproduce.model_rows_vs_alone(model, cache, (5, 2), 2)),
        "a padded prompt's logits batched differ from alone (its padding is attended)",
        "batched prompts' logits equal each alone",
    )
