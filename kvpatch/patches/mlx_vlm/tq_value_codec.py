"""tq-value-codec (catalogue V07): the batch TurboQuant cache builds its value codec from the keys.

Broken: in mlx-vlm 0.5.0–0.6.15 ``mlx_vlm.turboquant.BatchTurboQuantKVCache._ensure_codecs(keys)`` is
only given the keys and builds both codecs from them (``tmp._ensure_codecs(keys, keys)``). When the key
and value head dims differ (MLA-style 192/128, GLM-4 MoE Lite's latent/rope split) the first update
raises (2 rows, 2 heads, 4 tokens of 192-dim keys and 128-dim values): ``ValueError: [matmul] Last
dimension of first input with shape (2,2,4,128) must match second to last dimension of second input with
shape (192,192)`` in 0.5.0–0.6.3, ``[reshape] Cannot reshape array of size 2048 into shape (10,192)`` from
0.6.4 on (the catalogue's message). From 0.6.13, where ``value_bits`` can be set apart from
``key_bits``, a fractional value bit-width picks its higher-precision channels from the key tensor even
when the dims match: the batch cache then quantizes values worse than the single-row
``TurboQuantKVCache`` given the same input (measured on 0.6.13 and 0.6.15: mean value error 0.355 vs
0.289, dequantized values up to 3.38 apart).

Measured (Linux, mlx[cpu]): present in 0.5.0, 0.6.3, 0.6.4, 0.6.13 and 0.6.15; absent in 0.6.16, 0.7.6
and 0.7.10. The batch class first appears in 0.5.0 (git b0275383, #1030). Upstream fix: 0cdae975
(Blaizzy/mlx-vlm#1975), released in 0.6.16, which passes the values through.

Fix: a delta in front of ``update_and_fetch`` (the only caller of ``_ensure_codecs``). On the first
update (no codec yet) the codecs are built with the cache's own ``_ensure_codecs`` twice: once from the
values, keeping only its value codec, then from the keys, keeping its key codec. Each codec is thus
built, with upstream's own settings (bits, key/value bits, seed), from the tensor it will encode, which
is what the fixed release does. Then the original runs and finds the codecs present. Later updates
only pay one attribute check; no host synchronisation is added.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _reproduce
from kvpatch.patches._numbers import difference, judge, worst
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="tq-value-codec",
    summary="batch TurboQuant builds its value codec from the key tensor: crash when head dims differ",
    distribution="mlx-vlm",
    affected=">=0.5.0,<0.6.16",
    fixed_in="0.6.16",
    fixed_commit="0cdae975",
    introduced_commit="b0275383",
    reference="Blaizzy/mlx-vlm#1975",
    catalogue="V07",
    hot_path=True,
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-vlm < 0.6.16 (and git pins before 0cdae975)",
        review_by=_dt.date(2027, 6, 1),
    ),
)


@PATCH.replace("mlx_vlm.turboquant", "BatchTurboQuantKVCache.update_and_fetch")
def _build(original: Any) -> Any:
    def update_and_fetch(self: Any, keys: Any, values: Any) -> Any:
        if self.key_codec is None:
            self._ensure_codecs(values)  # builds both codecs from the values; keep the value codec
            value_codec = self.value_codec
            self.key_codec = None
            self._ensure_codecs(keys)  # builds both from the keys; keep the key codec
            self.value_codec = value_codec
        return original(self, keys, values)

    return update_and_fetch


@PATCH.reproduce
def reproduce() -> Finding:
    """Feed a batch TurboQuant cache keys and values of different head dims (96/64), and, where
    ``value_bits`` exists, a fractional value bit-width with matching dims: its dequantized keys and
    values must equal those of the single-row ``TurboQuantKVCache`` given the same input."""
    import inspect

    import mlx.core as mx

    try:
        from mlx_vlm.turboquant import BatchTurboQuantKVCache, TurboQuantKVCache
    except ImportError as exc:
        return _reproduce.absent(exc, "this mlx-vlm has no BatchTurboQuantKVCache")

    mx.random.seed(0)
    cases: list[tuple[str, dict[str, float], int, int]] = [("head dims 96/64, 4 bits", {"bits": 4}, 96, 64)]
    if "value_bits" in inspect.signature(BatchTurboQuantKVCache).parameters:
        cases.append(("head dims 64/64, value_bits 2.5", {"bits": 4, "key_bits": 4, "value_bits": 2.5}, 64, 64))

    problems, found = [], []
    for name, kwargs, dk, dv in cases:
        # keys and values loud in different channels, so a codec fitted to one is wrong for the other
        keys = mx.random.normal((2, 2, 4, dk)) * mx.linspace(3.0, 0.1, dk)
        values = mx.random.normal((2, 2, 4, dv)) * mx.linspace(0.1, 3.0, dv)
        single = TurboQuantKVCache(**kwargs)
        ref = single.dequantize(*single.update_and_fetch(keys, values))
        cache = BatchTurboQuantKVCache([0, 0], **kwargs)
        try:
            out = cache.dequantize(*cache.update_and_fetch(keys, values))
            mx.eval(out)
        except ValueError as exc:  # the bug's own error: values quantized with the keys' head dimension
            detail = symptom(exc, "[matmul] Last dimension", "[reshape] Cannot reshape")
            problems.append(f"{name}: update raises ValueError: {detail}")
            continue
        if out[1].shape != values.shape:
            problems.append(f"{name}: values come back as {out[1].shape}, fed {values.shape}")
            continue
        v_err = mx.abs(out[1] - values).mean().item()
        r_err = mx.abs(ref[1] - values).mean().item()
        where = f"{name} (mean value error {v_err:.3g}, the single-row cache's {r_err:.3g})"
        found.append(difference(out[0], ref[0], where=f"{name} keys"))
        found.append(difference(out[1], ref[1], where=f"{where} values"))
    return judge(
        worst(found),
        "batch dequantized K/V differ from the single-row cache's",
        "batch dequantized K/V equal the single-row cache's: " + ", ".join(c[0] for c in cases),
        problems=problems,
    )
