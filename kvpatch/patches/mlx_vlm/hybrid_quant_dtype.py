"""hybrid-quant-dtype: mlx-vlm's HybridQuantKVCache hands a bf16 model float32 keys or values every step.

Broken: ``mlx_vlm.turboquant.HybridQuantKVCache`` (mlx-vlm 0.6.12+, git ffd7aeff, #1807: per-tensor KV
quantization, ``--kv-key-scheme`` / ``--kv-value-scheme``) quantizes keys and values with separate
quantizers and returns ``dequantize()`` from ``update_and_fetch``. The TurboQuant side dequantizes to float32
whatever it was fed (the codec's float32 reconstruction, the same cause as ``tq-dequantize-dtype`` / V30);
the uniform side returns the fed dtype. Unlike the TurboQuant caches, whose quantized attention never
dequantizes per step, this cache's dense K/V go straight into attention on every step, so the float32
half promotes the attention output and, from there, every activation of a bf16 model. Measured (Linux,
mlx[cpu], bf16 keys/values in): TurboQuant/uniform gives float32 keys + bf16 values, uniform/TurboQuant the
reverse, TurboQuant/TurboQuant float32 for both; uniform/uniform stays bf16. A tiny bf16 pixtral language
model with this cache returns float32 logits (bf16 with ``KVCache``), on 0.6.12, 0.6.16, 0.7.0, 0.7.6, 0.7.8
and 0.7.10. Not fixed as of 0.7.10; not reported upstream.

Fix: deltas around the originals. ``update_and_fetch`` notes the dtypes it is fed (one attribute store, no
host synchronisation) before the original runs; ``dequantize`` (which ``update_and_fetch`` returns, and
which prefix-cache harvests call) casts its results to the noted dtypes, so the numbers are the
original's rounded once to the model's dtype. With the tiny bf16 model the logits then differ from the
float32-promoted run by at most 0.035 (logit scale 1.5: bf16 rounding of the activations). A cache that
was never fed (restored from ``state``) keeps upstream's dtypes until its next update.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _dtypes
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="hybrid-quant-dtype",
    summary="HybridQuantKVCache returns float32 K or V for a bf16/fp16 model (its TurboQuant side): dtype drift",
    distribution="mlx-vlm",
    affected=">=0.6.12,<=0.7.10",
    checked_through="0.7.10",
    introduced_commit="ffd7aeff",
    catalogue="N12 (HybridQuantKVCache dtype; twin of V30)",
    reference="not reported upstream (introduced by Blaizzy/mlx-vlm#1807)",
    hot_path=True,
    expiry=Expiry(
        "retire when mlx-vlm's HybridQuantKVCache returns the dtype it was fed",
        review_by=_dt.date(2027, 3, 1),
    ),
)

PATCH.replace("mlx_vlm.turboquant", "HybridQuantKVCache.update_and_fetch", optional=True)(_dtypes.noting)


@PATCH.replace("mlx_vlm.turboquant", "HybridQuantKVCache.dequantize", optional=True)
def _build_dequantize(original: Any) -> Any:
    def dequantize(self: Any) -> Any:
        keys, values = original(self)
        dtypes = getattr(self, _dtypes.DTYPES, None)
        if dtypes is not None:
            if keys.dtype != dtypes[0]:
                keys = keys.astype(dtypes[0])
            if values.dtype != dtypes[1]:
                values = values.astype(dtypes[1])
        return keys, values

    return dequantize


def policy(key_scheme: str, value_scheme: str) -> Any:
    from mlx_vlm.kv_quant import KVQuantPolicy, KVQuantSpec

    bits = {"turboquant": 3.0, "uniform": 4.0}
    return KVQuantPolicy(
        bits=3.5,
        key=KVQuantSpec(key_scheme, bits[key_scheme], 64),
        value=KVQuantSpec(value_scheme, bits[value_scheme], 64),
    )


@PATCH.reproduce
def reproduce() -> Finding:
    """Feed HybridQuantKVCache (TurboQuant keys, uniform values and the reverse) bf16 keys/values: what
    ``update_and_fetch`` and ``dequantize`` return must be bf16, the original's numbers rounded once."""
    import mlx.core as mx
    from mlx_vlm import turboquant

    if not hasattr(turboquant, "HybridQuantKVCache"):
        return Finding(False, "this mlx-vlm has no HybridQuantKVCache (before 0.6.12): nothing to fix")
    k1, k2 = mx.random.split(mx.random.key(0))
    keys = mx.random.normal((1, 2, 5, 64), key=k1).astype(mx.bfloat16)
    values = mx.random.normal((1, 2, 5, 64), key=k2).astype(mx.bfloat16)
    problems, notes = [], []
    for schemes in (("turboquant", "uniform"), ("uniform", "turboquant")):
        cache = turboquant.HybridQuantKVCache(policy(*schemes))
        got = cache.update_and_fetch(keys, values)
        again = cache.dequantize()
        dtypes = [str(a.dtype).split(".")[-1] for a in (*got, *again)]
        label = "/".join(schemes)
        if set(dtypes) != {"bfloat16"}:
            problems.append(f"{label} fed bfloat16: update_and_fetch -> {dtypes[:2]}, dequantize -> {dtypes[2:]}")
        else:
            notes.append(f"{label}: bfloat16 out")
    if problems:
        return Finding(True, "; ".join(problems))
    return Finding(False, "; ".join(notes))
