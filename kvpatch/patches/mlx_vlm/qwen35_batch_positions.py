"""qwen35-batch-positions: mlx-vlm's ``Qwen3_5Attention`` derives positions from a batch cache's offset wrongly.

Broken: ``mlx_vlm.models.qwen3_5.language.Qwen3_5Attention.__call__`` (Qwen3.5 / Qwen3.6 full-attention layers),
given no ``position_ids``, derives them from ``cache.offset``. With a batch cache (per-row ``offset`` array):

* 0.5.0-0.6.2: ``mx.arange(cache.offset, cache.offset + L)`` raises ``TypeError: arange(): incompatible function
  arguments``;
* 0.6.3-0.7.10 (git 7267aff2, Blaizzy/mlx-vlm#1313, made the array case run): the positions are
  ``max(offset, 0) + arange(L)``. A left-padded row starts at a negative offset, so its prefill positions are
  clamped onto the pad slots (its real tokens sit ``padding`` positions later than alone) while its decode
  positions come from the unclamped offset: prefill and decode disagree and the row's decode output differs from
  the row alone.

Measured (Linux, mlx[cpu]; one tiny random ``Qwen3_5Attention`` from ``TextConfig``, a 2-row batch padded
``[4, 0]``, ``BatchKVCache`` masks, ``position_ids`` left to the layer, prefill and 3 decode steps against each row
with a ``KVCache``): TypeError on 0.5.0; on 0.7.10 the padded row's decode outputs differ by 0.05-0.10 (prefill and
the unpadded row exact). ``LanguageModel`` passes ``position_ids`` itself, so mlx-vlm's own generators do not reach
this; servers that drive the layers (vllm-mlx replaces this method) and callers that leave positions to the layer
do. vllm-mlx's replacement uses the largest offset for every row, one position convention for prefill and decode.

Upstream: 7267aff2 (#1313, 0.6.3) is upstream's partial fix (see above); not fixed as of 0.7.10.

Not in this patch, upstream's contract: ``LanguageModel.__call__`` given a left-padded batch with neither
``position_ids`` nor a 2-D ``attention_mask`` computes the prompt's mRoPE positions over the padded row (pads
included; its own derivation of a mask from ``cache.left_padding`` runs only when the cache offset is not a per-row
array of several rows, and a batch cache's is), while decode positions come from the row's offset (pads excluded).
Measured on 0.7.10 (the tiny model of :func:`tiny_config` as a ``LanguageModel``, prompts of 5 and 9 tokens, 3
decode steps): the padded row's decode logits differ from the row alone by 0.079, 0.082, 0.045 without either; 0.0
with the 2-D ``attention_mask``; 0.0 through mlx-vlm's own ``BatchGenerator``, which passes each row's
``position_ids`` from ``get_input_embeddings``. As with Hugging Face's ``get_rope_index``, a padded batch needs the
mask or the positions.

Fix: a delta in front of the original: when ``position_ids`` is None and the cache's ``offset`` is a per-row array,
each row's positions are ``offset[:, None] + arange(L)`` (``_mrope.row_positions``; the pad slots get negative
positions, masked) and handed to the original, which then takes its given-positions path. Each row gets the
positions it has alone, in prefill and in decode. Anything else goes to the original unchanged. No host
synchronisation; the layer runs per full-attention layer per step, so the replacement is a plain function with one
``is None`` test for callers that pass positions (mlx-vlm's own ``LanguageModel``).
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _mrope, _reproduce
from kvpatch.patches._numbers import Difference, judge, worst
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="qwen35-batch-positions",
    summary="Qwen3_5Attention derives positions from a batch cache offset: TypeError (<0.6.3) or padded rows drift",
    distribution="mlx-vlm",
    affected=">=0.5.0,<=0.7.10",
    checked_through="0.7.10",
    reference="Blaizzy/mlx-vlm#1313 (7267aff2, partial: clamps the offset at 0); vllm-mlx replaces the method "
    "(vllm_mlx/patches/qwen3_5_mllm.py)",
    catalogue="issue 29 item 5",
    hot_path=True,
    expiry=Expiry(
        "retire when mlx-vlm's Qwen3_5Attention gives each row of a batch cache its own positions",
        review_by=_dt.date(2027, 3, 1),
    ),
)


# optional: mlx-vlm 0.6.0-0.6.3 build a Metal kernel when this module is imported, so without Metal it cannot be
# imported at all (nothing to patch there, and no failure of kvpatch's)
@PATCH.replace("mlx_vlm.models.qwen3_5.language", "Qwen3_5Attention.__call__", optional=True)
def _build(original: Any) -> Any:
    import mlx.core as mx

    positions = _mrope.row_positions(mx)

    def __call__(self: Any, x: Any, mask: Any = None, cache: Any = None, position_ids: Any = None, *a: Any, **k: Any):
        if position_ids is None and cache is not None:
            position_ids = positions(cache.offset, x.shape[1])
        return original(self, x, mask, cache, position_ids, *a, **k)

    return __call__


def tiny_config() -> Any:
    """A tiny Qwen3.5 ``TextConfig`` (4 layers, hidden 64, 4 heads, 2 KV heads of 16, mRoPE sections 2/1/1)."""
    from mlx_vlm.models.qwen3_5.config import TextConfig

    return TextConfig(
        model_type="qwen3_5", hidden_size=64, intermediate_size=128, linear_num_value_heads=2, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_hidden_layers=4,
        num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=64, num_key_value_heads=2, max_position_embeddings=512,
        head_dim=16,
        rope_parameters={"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000,
                         "partial_rotary_factor": 0.5},
    )  # fmt: skip


def tiny_attention() -> Any:
    """A tiny random Qwen3.5 full-attention layer (:func:`tiny_config`)."""
    from mlx_vlm.models.qwen3_5.language import Qwen3_5Attention

    return _reproduce.seeded(Qwen3_5Attention, tiny_config())


def batched_vs_alone(attention: Any, lengths: tuple[int, ...] = (5, 9), steps: int = 3) -> list[Difference]:
    """Each row of a left-padded batch (``BatchKVCache`` and its masks, ``position_ids`` left to the layer) against
    the row alone (``KVCache``): the largest difference of the last position's output over prefill and ``steps``
    decode steps, per row."""
    import mlx.core as mx
    from mlx_vlm.models.cache import BatchKVCache, KVCache

    rows = len(lengths)
    keys = mx.random.split(mx.random.key(1), rows + 1)
    prompts = [mx.random.normal((1, n, 64), key=keys[i]) for i, n in enumerate(lengths)]
    decode = mx.random.normal((steps, rows, 1, 64), key=keys[-1])
    alone = []
    for row, prompt in enumerate(prompts):
        cache = KVCache()
        outs = [attention(prompt, mask="causal", cache=cache)[:, -1]]
        outs += [attention(decode[s, row : row + 1], cache=cache)[:, -1] for s in range(steps)]
        alone.append(outs)
    padding, batch = _reproduce.left_padded(prompts)
    cache = BatchKVCache(padding)
    outs = [attention(batch, mask=cache.make_mask(max(lengths), return_array=True), cache=cache)[:, -1]]
    for s in range(steps):
        outs.append(attention(decode[s], mask=cache.make_mask(1, return_array=True), cache=cache)[:, -1])
    return _reproduce.row_differences(outs, alone)


@PATCH.reproduce
def reproduce() -> Finding:
    """A tiny Qwen3_5Attention over a left-padded batch with per-row cache offsets, against each row alone."""
    rows = _reproduce.rows_vs_alone(
        tiny_attention, batched_vs_alone, "Qwen3_5Attention", "this mlx-vlm has no qwen3_5 model"
    )
    if isinstance(rows, Finding):
        return rows
    return judge(
        worst(rows),
        "left-padded batch rows differ from each row alone (prefill and decode)",
        "batched rows equal each row alone",
    )
