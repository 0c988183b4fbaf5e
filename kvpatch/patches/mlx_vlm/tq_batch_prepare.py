"""tq-batch-prepare: the batch TurboQuant cache has no ``prepare()``/``finalize()``: APC mixed prefill fails.

Broken: mlx-vlm's prefix cache (``APC_ENABLED=1``) admits a batch whose rows have different cached prefix
lengths as one *mixed* prefill: each row's uncached suffix is right-padded to the longest one, every layer
cache gets ``prepare(right_padding=..., lengths=...)`` before the prefill and ``finalize()`` after it (which
rolls each row's right padding into left padding, so decoding sees the canonical left-padded layout).
``PromptProcessingBatch`` checks for the two methods and raises ``RuntimeError: APC mixed prefill requires a
prompt cache with prepare()`` when a cache lacks them. ``BatchKVCache`` and ``BatchQuantizedKVCache`` have
them; ``BatchTurboQuantKVCache`` never had them. So ``mlx_vlm.server`` with ``APC_ENABLED=1 --kv-bits 3.5
--kv-quant-scheme turboquant --quantized-kv-start 0`` answers HTTP 500 to most concurrent requests (single
requests take the cold path and work). Reproduced without a server: a two-row right-padded
``PromptProcessingBatch`` with ``kv_bits=3.5, kv_quant_scheme="turboquant"`` raises it on construction.
Measured on every mlx-vlm wheel from 0.5.0 (the first with the mixed prefill and the batch TurboQuant
cache; 0.4.4 has neither) to 0.7.10 (see the record); not fixed upstream, not reported upstream.

Fix: add the two methods to ``BatchTurboQuantKVCache`` with ``BatchKVCache``'s contract (the same keyword
arguments, the same effect on ``offset`` / ``left_padding``): ``prepare(left_padding=)`` grows the left
padding of an empty cache; ``prepare(right_padding=, lengths=)`` records the right padding; ``finalize()``
rolls every array of the packed key/value state (norms, indices, signs: token axis 2 in every TurboQuant
state) right by each row's padding, subtracts it from ``offset`` and adds it to ``left_padding``, and
refreshes the fused-kernel eligibility flag where the release has one (a host read, once per prefill, as
upstream's ``filter``/``extend`` do). A cold path: once per admitted batch.

Adding a method flips capability checks: every ``getattr(cache, "prepare")`` / ``hasattr`` in the process now
sees one on TurboQuant caches. Callers in mlx-vlm 0.7.10 and what they get now: the APC mixed prefill
(``generate/ar.py``: prepare before, finalize after: the fixed path); ``speculative/cache_state.py`` (ragged
speculative rollback: prepare(lengths, right_padding), updates, finalize; and its capability check
``keys is not None and callable(prepare) and callable(finalize)`` that now takes the right-trim route instead
of a dense ``_idx`` path TurboQuant state cannot take); LFM2's ragged rollback (prepare(right_padding) then
finalize() on a filled cache: the tail rows rolled into left padding, as for ``BatchKVCache``, instead of
``NotImplementedError``); cohere-compass (``prepare(left_padding=)`` on fresh caches) and ``CacheList``
(forwards both). All of them use ``BatchKVCache``'s contract, which the added methods implement; mlx-lm
never sees TurboQuant caches. ``extend``/``filter``/``extract`` read ``left_padding``/``_idx`` as before.
"""

from __future__ import annotations

import datetime as _dt
import inspect
from typing import Any

from kvpatch.patches import _pending
from kvpatch.patches._numbers import difference, judge, worst
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="tq-batch-prepare",
    summary="BatchTurboQuantKVCache has no prepare()/finalize(): APC mixed prefill raises RuntimeError (HTTP 500)",
    distribution="mlx-vlm",
    affected=">=0.5.0,<=0.7.10",
    checked_through="0.7.10",
    catalogue="N13 (issue 11 item 8)",
    reference="not reported upstream",
    expiry=Expiry(
        "retire when mlx-vlm's BatchTurboQuantKVCache implements prepare()/finalize()",
        review_by=_dt.date(2027, 3, 1),
    ),
)


def _roll(mx: Any) -> Any:
    """``roll(x, shifts)``: row ``b`` of ``x`` rolled by ``shifts[b]`` along the token axis (2)."""

    def roll(x: Any, shifts: Any) -> Any:
        n = x.shape[2]
        index = (mx.arange(n) - shifts.reshape(-1, 1)) % n  # (B, n)
        index = index.reshape(index.shape[0], 1, n, *([1] * (x.ndim - 3)))
        return mx.take_along_axis(x, mx.broadcast_to(index, (*x.shape[:2], n, *x.shape[3:])), axis=2)

    return roll


@PATCH.add("mlx_vlm.turboquant", "BatchTurboQuantKVCache.prepare")
def _build_prepare(_: Any) -> Any:
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    return _pending.prepare(getattr(BatchTurboQuantKVCache, "_refresh_fused_attention_eligibility", None))


@PATCH.add("mlx_vlm.turboquant", "BatchTurboQuantKVCache.finalize")
def _build_finalize(_: Any) -> Any:
    import mlx.core as mx
    from mlx_vlm import turboquant
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    map_state = turboquant._map_state
    roll = _roll(mx)
    refresh = getattr(BatchTurboQuantKVCache, "_refresh_fused_attention_eligibility", None)

    def finalize(self: Any) -> None:
        """Roll right padding into left padding after a right-padded prefill (added by kvpatch tq-batch-prepare)."""
        padding = getattr(self, "_right_padding", None)
        if padding is None:
            return
        self._right_padding = None
        if self.keys is None:
            return
        self.keys = map_state(self.keys, lambda a, _ndim: roll(a, padding))
        self.values = map_state(self.values, lambda a, _ndim: roll(a, padding))
        self.offset = self.offset - padding
        self.left_padding = self.left_padding + padding
        if refresh is not None:
            refresh(self)

    return finalize


# -- reproduction ----------------------------------------------------------------------------------
ROWS = ([3, 14, 15, 9, 26, 5, 35, 8, 9], [27, 18, 28, 18, 28])  # 9 and 5 tokens: the short row is right-padded


def prompt_batch_class() -> Any:
    import importlib

    generate = importlib.import_module("mlx_vlm.generate")
    cls = getattr(generate, "PromptProcessingBatch", None)
    if cls is None:
        cls = importlib.import_module("mlx_vlm.generate.ar").PromptProcessingBatch
    return cls


def run_rows(model: Any, rows: list[list[int]], *, mixed: bool) -> tuple[list[list[int]], list[Any]]:
    """Prefill ``rows`` as one TurboQuant 3.5-bit batch (``mixed``: right-padded, the APC mixed-prefill layout)
    and decode 3 greedy tokens per row; return the tokens and the caches the decode went on with, one per layer."""
    import mlx.core as mx

    cls = prompt_batch_class()
    width = max(map(len, rows))
    embed = model.model.embed_tokens
    inputs_embeds = mx.concatenate([embed(mx.array([r + [0] * (width - len(r))])) for r in rows])
    kwargs: dict[str, Any] = dict(
        uids=list(range(len(rows))),
        input_ids=[list(r) for r in rows],
        max_tokens=[4] * len(rows),
        inputs_embeds=inputs_embeds,
        prompt_kwargs={},
        prefill_step_size=64,  # one forward, as the server does for prompts shorter than its prefill step
        kv_bits=3.5,
        kv_quant_scheme="turboquant",
        quantized_kv_start=0,
    )
    if mixed:
        kwargs.update(right_pad_per_row=[width - len(r) for r in rows], suffix_lens=[len(r) for r in rows])
    accepted = inspect.signature(cls).parameters
    batch = cls(model, **{k: v for k, v in kwargs.items() if k in accepted})
    # One forward over the whole right-padded batch (generate() straight away): what the cache's prepare /
    # finalize must get right. Chunked prefill (prompt_step) is left out on purpose: mlx-vlm 0.6.x-0.7.0 pick
    # a padded row's first-token logits from the last chunk only (fixed in 0.7.2), for every cache class.
    generation = batch.generate(lambda logprobs: mx.argmax(logprobs, axis=-1), lambda token: False)
    tokens: dict[int, list[int]] = {uid: [] for uid in range(len(rows))}
    # 3 of the 4 tokens: no row finishes, so the decode's caches still hold every row (a finished batch empties them)
    while min(map(len, tokens.values())) < 3:
        responses = generation.next()
        if not responses:
            break
        for r in responses:
            tokens[r.uid].append(int(r.token))
    return [tokens[uid] for uid in range(len(rows))], list(getattr(generation, "prompt_cache", None) or [])


def row_state(cache: Any, row: int) -> tuple[int, Any, Any]:
    """(offset, dequantized keys, values) of one row's valid positions."""
    import mlx.core as mx

    keys, values = cache.dequantize()
    start = int(cache.left_padding[row].item())
    end = keys.shape[2] if not hasattr(cache, "_idx") else cache._idx
    return int(cache.offset[row].item()), keys[row, :, start:end], values[row, :, start:end].astype(mx.float32)


@PATCH.reproduce
def reproduce() -> Finding:
    """A right-padded (APC mixed prefill) two-row batch with TurboQuant 3.5 bits, against each row alone."""

    from kvpatch.patches._reproduce import tiny_pixtral_language_model

    model = tiny_pixtral_language_model(head_dim=32)
    try:
        tokens, cache = run_rows(model, [list(r) for r in ROWS], mixed=True)
    except RuntimeError as exc:
        return Finding(True, f"mixed prefill with TurboQuant raises RuntimeError: {symptom(exc, 'prompt cache with')}")
    problems, found = [], []
    for row, prompt in enumerate(ROWS):
        alone_tokens, alone = run_rows(model, [list(prompt)], mixed=False)
        for layer, (c, a) in enumerate(zip(cache, alone, strict=True)):
            offset, keys, values = row_state(c, row)
            a_offset, a_keys, a_values = row_state(a, 0)
            if offset != a_offset or keys.shape != a_keys.shape:
                problems.append(f"row {row} layer {layer}: offset {offset} ({keys.shape[1]} kept); alone {a_offset}")
                continue
            # keys and values computed by the model (batched and alone), quantized, read back
            found.append(difference(keys, a_keys, where=f"row {row} layer {layer} cached keys"))
            found.append(difference(values, a_values, where=f"row {row} layer {layer} cached values"))
        if tokens[row] != alone_tokens[0]:
            problems.append(f"row {row}: decodes {tokens[row]}, alone {alone_tokens[0]}")
    return judge(
        worst(found),
        "mixed prefill ran but its cached keys/values differ from each row alone",
        f"mixed prefill == each row alone: decodes {tokens}, cached keys/values",
        problems=[f"mixed prefill ran but is wrong: {p}" for p in problems],
    )
