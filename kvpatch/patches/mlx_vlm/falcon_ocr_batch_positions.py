"""falcon-ocr-batch-positions (catalogue issue 36 (found by the bug hunt)): falcon_ocr clamps a batch's offsets
before adding positions: a left-padded row's prompt sits later than its decode.

Broken: ``mlx_vlm.models.falcon_ocr.language.FalconOCRTransformerModel.__call__``, given no ``position_ids`` (text
prompts: ``get_input_embeddings`` returns none, and ``LanguageModel`` derives them only from image ``rope_deltas``)
and a batch cache (a per-row ``offset`` array), takes the positions as ``mx.maximum(offset, 0) + arange(L)``. A
left-padded row's prompt offset is minus its padding, clamped to 0, so its real tokens sit ``padding`` positions
later than alone, while each decode step takes the row's own offset (its real length). The prompt's logits agree
(RoPE is relative), but every generated token of a padded row sees its prompt nearer by the padding: batched
generation (mlx-vlm's ``BatchGenerator`` left-pads) gives padded rows other logits than the prompt alone. mlx-vlm
0.5.0-0.7.10 (0.4.x raise ``Only length-1 arrays`` on the batch offset instead). Measured (Linux, mlx[cpu]; the
reproduction's tiny random ``LanguageModel``, prompts of 5, 2 and 4 tokens left-padded in a ``BatchKVCache`` per
layer, the prompt and 2 decode steps against each prompt alone): the padded rows' decode logits differ by 0.52 (padded
by 3) and 0.23 (by 1) on 0.5.0, 0.6.13 and 0.7.10; the prompt step and the unpadded row exactly 0.

Upstream: not reported upstream (found by kvpatch's bug hunt); not fixed as of 0.7.10. ``qwen35-batch-positions``
mends the same clamp in Qwen3.5's attention; falcon_perception's copy is left (docs/findings.md: that model builds
no padding mask at all).

Fix: a delta in front of the original: when ``position_ids`` is None and the first cache's ``offset`` is a per-row
array of several rows, the positions are ``offset[:, None] + arange(L)``, clamped at 0 after the addition (the pad
slots, masked, index the rotary table), and handed to the original, which takes its given-positions path. A row's
decode positions are unchanged (its offset is not negative), its prompt gets the positions it has alone. Anything
else goes to the original as it came. No host synchronisation: the replacement runs once per forward pass, a plain
function with an ``is None`` test for callers that pass positions.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _reproduce
from kvpatch.patches._numbers import Difference, judge, worst
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    # every field: CONTRIBUTING.md, "The record"
    id="falcon-ocr-batch-positions",
    summary=(
        "falcon_ocr clamps a batch's offsets before adding positions: a left-padded row's prompt sits later than its "
        "decode"
    ),
    distribution="mlx-vlm",
    affected=">=0.5.0,<=0.7.10",
    checked_through="0.7.10",
    reference="not reported upstream (found by kvpatch's bug hunt)",
    catalogue="issue 36 (found by the bug hunt)",
    hot_path=True,
    expiry=Expiry(
        "retire when an mlx-vlm release fixes it (`python -m kvpatch upstream-check` measures the newest)",
        review_by=_dt.date(2027, 5, 30),
    ),
)


@PATCH.replace("mlx_vlm.models.falcon_ocr.language", "FalconOCRTransformerModel.__call__")
def _build(original: Any) -> Any:
    import mlx.core as mx

    array, arange, maximum = mx.array, mx.arange, mx.maximum

    def __call__(
        self: Any,
        inputs: Any,
        inputs_embeds: Any = None,
        mask: Any = None,
        cache: Any = None,
        position_ids: Any = None,
        pos_hw: Any = None,
        **kwargs: Any,
    ) -> Any:
        if position_ids is None and cache is not None and cache[0] is not None:
            offset = cache[0].offset
            if isinstance(offset, array) and offset.ndim == 1 and offset.size > 1:
                length = (inputs if inputs_embeds is None else inputs_embeds).shape[1]
                position_ids = maximum(offset[:, None] + arange(length), 0)
        return original(self, inputs, inputs_embeds, mask, cache, position_ids, pos_hw, **kwargs)

    return __call__


#: The tiny text config (a ``TextConfig`` field set, also the ``ModelConfig``'s text_config).
TINY_TEXT = {
    "model_type": "falcon_ocr", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "head_dim": 32,
    "num_key_value_heads": 2, "vocab_size": 128, "intermediate_size": 128, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256, "rope_theta": 10000.0,
}  # fmt: skip


def tiny_model() -> Any:
    """A tiny random falcon_ocr ``LanguageModel`` (3 layers, hidden 64, 4 heads over 2 KV heads of 32)."""
    from mlx_vlm.models.falcon_ocr.config import ModelConfig, TextConfig
    from mlx_vlm.models.falcon_ocr.language import LanguageModel

    config = ModelConfig.from_dict({"model_type": "falcon_ocr", "vocab_size": 128, "text_config": dict(TINY_TEXT)})
    config.text_config = TextConfig(**TINY_TEXT)
    return _reproduce.seeded(LanguageModel, config.text_config, config)


def batched_vs_alone(model: Any, lengths: tuple[int, ...] = (5, 2, 4), steps: int = 2) -> list[Difference]:
    """Each prompt of a left-padded batch (a ``BatchKVCache`` per layer, no positions given) against the prompt alone,
    per row, over the prompt and ``steps`` decode steps (:func:`~kvpatch.patches._reproduce.model_rows_vs_alone` with
    mlx-vlm's caches)."""
    from mlx_vlm.models import cache

    return _reproduce.model_rows_vs_alone(model, cache, lengths, steps)


@PATCH.reproduce
def reproduce() -> Finding:
    """A tiny falcon_ocr language model over a left-padded batch with per-row cache offsets, against each prompt
    alone."""
    rows = _reproduce.rows_vs_alone(tiny_model, batched_vs_alone, "falcon_ocr", "this mlx-vlm has no falcon_ocr model")
    if isinstance(rows, Finding):
        return rows
    return judge(
        worst(rows),
        "left-padded batch rows differ from each prompt alone (decode)",
        "batched rows equal each prompt alone",
    )
