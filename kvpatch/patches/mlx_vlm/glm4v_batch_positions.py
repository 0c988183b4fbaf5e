"""glm4v-batch-positions: mlx-vlm's glm4v_moe ``GLM4VModel.__call__`` assumes an integer cache offset, and a fresh
``LanguageModel`` positions left-padded rows' prefill and decode inconsistently.

Broken: ``mlx_vlm.models.glm4v_moe.language.GLM4VModel.__call__``, given no ``position_ids``, computes them as
``mx.arange(cache[0].offset, cache[0].offset + L)``. With a batch cache (``BatchKVCache``, whose ``offset`` is a
per-row array) ``mx.arange`` raises ``TypeError: arange(): incompatible function arguments``. ``LanguageModel``
passes ``position_ids`` itself unless it is given a mask that is not 2-D (``rope_mask.ndim != 2``), so the
batched path fails for callers that hand the model a 4-D mask or drive ``GLM4VModel`` directly, as servers do
(vllm-mlx carries its own replacement of this method). Measured (Linux, mlx[cpu]; a tiny random glm4v_moe from
its ``TextConfig``, a left-padded 2-row batch, ``GLM4VModel`` called with ``position_ids=None``): the TypeError
on 0.4.4, 0.5.0, 0.6.4 and 0.7.10 (the line is unchanged since the model came, 0.3.3, git 287c20b3). In range from
0.5.0, the first release whose batch path this model follows: on 0.4.4 ``GLM4VModel`` builds its mask with
``create_attention_mask(h, cache)`` from the list of caches, which ignores left padding, so with positions fixed
the padded row still differs from the row alone by 1.6 (batching this model there is not a kvpatch fix). glm4v's
``GLM4VModel`` and ``LanguageModel`` (``mlx_vlm.models.glm4v.language``, the dense model of the family) are the same
code and get the same deltas: measured with the reproduction's tiny dense config, the TypeError and a fresh
``LanguageModel``'s 0.35 on 0.5.0, 0.6.4 and 0.7.10, 0 with the patch; through mlx-vlm's ``BatchGenerator`` on a
fresh model (the bug hunt's model level) 0.17 on 0.7.10, agreeing with the patch. The same ``arange`` line is in
``glm_ocr`` and ``paddleocr_vl`` (not measured, not patched here).

Upstream: not reported, not fixed as of 0.7.10 (``LanguageModel`` of the same file builds per-row positions from
``cache_offsets`` in its decode path; ``GLM4VModel`` was not given the same).

Also broken, on the path mlx-vlm's own ``BatchGenerator`` takes (its server and ``batch_generate``):
``LanguageModel.__call__`` given no ``position_ids`` builds a left-padded batch's prefill positions with
``get_rope_index`` whenever the model holds no ``_rope_deltas`` (a fresh model, or the first text request after an
image request reset them): without an attention mask those are ``arange(L)`` over the padded row (pads included),
with a 2-D mask they exclude the pads but the ``rope_deltas`` they return (``-padding``) are then added to the cache
offset, which already excludes them. Either way a padded row's decode positions disagree with its prefill ones.
Measured (Linux, mlx[cpu], 0.7.10; a tiny random glm4v_moe ``LanguageModel``, prompts of 5 and 9 tokens, a fresh
model, ``BatchKVCache`` per layer, no positions and no mask, as the generator passes for text): the padded row's
decode logits differ from the row alone by 0.11, 0.14, 0.21 over three steps (``scripts/probe_batch_models.py``;
0.14 in this unit's reproduction; prefill and the unpadded row exact), the same on 0.5.0 and 0.6.4, and the same
with a 2-D mask; through ``BatchGenerator`` itself the padded row's first decode token log-probability is -3.1038
against -3.1614 alone. Once ``_rope_deltas`` is set (any earlier text request) the same call takes upstream's per-row
branch (``offset + rope_deltas``) and is exact.

Fix: deltas in front of the originals. ``GLM4VModel.__call__``: when ``position_ids`` is None and the first cache's
``offset`` is a per-row array, the positions are built per row, ``offset[:, None] + arange(L)`` repeated over the 3
mRoPE sections (the ``(3, B, L)`` layout ``LanguageModel`` passes), and handed to the original; each row then gets the
positions it has alone (its left padding at negative positions, masked). ``LanguageModel.__call__``: in the state
above (no ``position_ids`` or ``pixel_values`` given, no rope state held) with a per-row cache offset, the model is
given the zero ``rope_deltas`` a text prompt's ``get_rope_index`` returns (the state upstream's own call leaves
behind) before the original runs, so the original takes its per-row branch for this call and the next ones:
``offset + rope_deltas + arange(L)``, a ``rope_deltas`` argument (as the generator passes in decode) taking precedence
as upstream has it. Anything else goes to the originals as it is. Lazy, no host synchronisation; one check per
forward pass (not per layer).
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import replace
from functools import partial
from typing import Any

from kvpatch.patches import _mrope, _reproduce
from kvpatch.patches._numbers import Difference, judge, worst
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="glm4v-batch-positions",
    summary="glm4v_moe / glm4v GLM4VModel builds position_ids with mx.arange(cache.offset): batch caches raise "
    "TypeError; a fresh LanguageModel gives left-padded rows prefill positions their decode disagrees with",
    distribution="mlx-vlm",
    affected=">=0.5.0,<=0.7.10",
    checked_through="0.7.10",
    reference="not reported upstream (mlx_vlm/models/glm4v_moe/language.py, GLM4VModel.__call__ and "
    "LanguageModel.__call__; vllm-mlx patches GLM4VModel in vllm_mlx/patches/glm4v_moe_mllm.py)",
    catalogue="issue 29 item 5",
    hot_path=True,
    expiry=Expiry(
        "retire when mlx-vlm's GLM4VModel and LanguageModel build per-row position_ids for an array cache offset",
        review_by=_dt.date(2027, 3, 1),
    ),
)


@PATCH.replace("mlx_vlm.models.glm4v_moe.language", "GLM4VModel.__call__")
def _build(original: Any) -> Any:
    import mlx.core as mx

    positions = _mrope.row_positions(mx)

    def __call__(
        self: Any,
        inputs: Any,
        inputs_embeds: Any = None,
        cache: Any = None,
        mask: Any = None,
        position_ids: Any = None,
    ) -> Any:
        if position_ids is None and cache and cache[0] is not None:
            length = (inputs if inputs_embeds is None else inputs_embeds).shape[1]
            position_ids = positions(cache[0].offset, length)
        return original(self, inputs, inputs_embeds, cache, mask, position_ids)

    return __call__


@PATCH.replace("mlx_vlm.models.glm4v_moe.language", "LanguageModel.__call__")
def _build_language(original: Any) -> Any:
    import mlx.core as mx

    array, zeros, int32 = mx.array, mx.zeros, mx.int32

    def __call__(self: Any, inputs: Any, inputs_embeds: Any = None, mask: Any = None, cache: Any = None, **kwargs: Any):
        if self._rope_deltas is None and self._position_ids is None and cache and cache[0] is not None:
            offset = cache[0].offset
            if (
                isinstance(offset, array)
                and offset.size > 1
                and kwargs.get("position_ids") is None
                and kwargs.get("pixel_values") is None
            ):
                self._rope_deltas = zeros((inputs.shape[0], 1), dtype=int32)
        return original(self, inputs, inputs_embeds, mask, cache, **kwargs)

    return __call__


# glm4v's GLM4VModel and LanguageModel are glm4v_moe's code (the dense model of the same family): the same deltas
PATCH.replace("mlx_vlm.models.glm4v.language", "GLM4VModel.__call__")(_build)
PATCH.replace("mlx_vlm.models.glm4v.language", "LanguageModel.__call__")(_build_language)

#: The two architectures: the mixture-of-experts model and the dense one.
ARCHS = ("glm4v_moe", "glm4v")


def tiny_config(arch: str = "glm4v_moe") -> Any:
    """A tiny ``TextConfig`` of ``arch`` (2 layers, hidden 64, 4 heads, 2 KV heads of 16, vocabulary 64; glm4v_moe:
    4 experts)."""
    if arch == "glm4v":
        from mlx_vlm.models.glm4v.config import TextConfig as Dense

        return Dense(
            model_type="glm4v", vocab_size=64, hidden_size=64, intermediate_size=128, max_position_embeddings=512,
            num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, rms_norm_eps=1e-6,
            attention_bias=False, partial_rotary_factor=0.5, rope_theta=10000.0,
            rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1]},
        )  # fmt: skip
    from mlx_vlm.models.glm4v_moe.config import TextConfig

    return TextConfig(
        model_type="glm4v_moe", vocab_size=64, hidden_size=64, intermediate_size=128, max_position_embeddings=512,
        moe_intermediate_size=32, norm_topk_prob=True, num_attention_heads=4, n_group=1, head_dim=16, topk_group=1,
        n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0, num_experts_per_tok=2,
        first_k_dense_replace=1, num_hidden_layers=2, num_key_value_heads=2, rms_norm_eps=1e-6, use_qk_norm=False,
        attention_bias=False, partial_rotary_factor=0.5, rope_theta=10000.0,
        rope_scaling={"type": "default", "mrope_section": [2, 1, 1]},
    )  # fmt: skip


def tiny_model(arch: str = "glm4v_moe") -> Any:
    """A tiny random ``GLM4VModel`` of ``arch`` (:func:`tiny_config`)."""
    import importlib

    return _reproduce.seeded(importlib.import_module(f"mlx_vlm.models.{arch}.language").GLM4VModel, tiny_config(arch))


def batched_vs_alone(model: Any, lengths: tuple[int, ...] = (5, 9), steps: int = 2) -> list[Difference]:
    """Each row of a left-padded batch (``BatchKVCache`` per layer, ``position_ids`` left to the model) against
    the row alone (``KVCache``): the largest difference of the last position's output (a ``GLM4VModel``'s hidden
    states, a ``LanguageModel``'s logits) over prefill and ``steps`` decode steps, per row. A ``LanguageModel``
    starts each run holding no rope state, as a fresh model does (and no mask: what mlx-vlm's batch generator
    passes for a text prompt)."""
    import mlx.core as mx
    from mlx_vlm.models.cache import BatchKVCache, KVCache

    def run(tokens: list[Any], cache: list[Any]) -> list[Any]:
        if hasattr(model, "_rope_deltas"):
            model._rope_deltas = model._position_ids = None
        return [getattr(out, "logits", out)[:, -1] for out in (model(t, cache=cache) for t in tokens)]

    layers = len(model.layers)
    keys = mx.random.split(mx.random.key(1), len(lengths) + 1)
    prompts = [mx.random.randint(1, 60, (1, n), key=keys[i]) for i, n in enumerate(lengths)]
    decode = mx.random.randint(1, 60, (steps, len(lengths), 1), key=keys[-1])
    alone = [
        run([prompt, *(decode[s, row : row + 1] for s in range(steps))], [KVCache() for _ in range(layers)])
        for row, prompt in enumerate(prompts)
    ]
    padding, batch = _reproduce.left_padded(prompts)
    return _reproduce.row_differences(run([batch, *decode], [BatchKVCache(padding) for _ in range(layers)]), alone)


def tiny_language_model(arch: str = "glm4v_moe") -> Any:
    """A tiny random ``LanguageModel`` of ``arch`` (:func:`tiny_config`; the vision fields ``get_rope_index``
    reads)."""
    import importlib
    from types import SimpleNamespace

    language = importlib.import_module(f"mlx_vlm.models.{arch}.language")
    vision = SimpleNamespace(
        vision_config=SimpleNamespace(spatial_merge_size=2), image_token_id=61, video_token_id=62,
        vision_start_token_id=63,
    )  # fmt: skip
    return _reproduce.seeded(language.LanguageModel, tiny_config(arch), vision)


@PATCH.reproduce
def reproduce() -> Finding:
    """A tiny GLM4VModel, then a fresh LanguageModel, of glm4v_moe and of glm4v, over a left-padded batch with per-row
    cache offsets, against each row alone."""
    found: list[Difference] = []
    for arch in ARCHS:
        rows = _reproduce.rows_vs_alone(
            partial(tiny_model, arch), batched_vs_alone, f"{arch} GLM4VModel", f"this mlx-vlm has no {arch}"
        )
        if isinstance(rows, Finding):
            return rows
        language = batched_vs_alone(tiny_language_model(arch), steps=3)
        found += [replace(d, where=f"{arch} GLM4VModel {d.where}") for d in rows]
        found += [replace(d, where=f"a fresh {arch} LanguageModel {d.where}") for d in language]
    return judge(worst(found), "left-padded batch rows differ from each row alone", "batched rows equal each row alone")
