"""tq-dequantize-dtype (catalogue V30): TurboQuant caches dequantize to float32 whatever they were fed.

Broken: ``dequantize()`` of ``mlx_vlm.turboquant.TurboQuantKVCache`` (mlx-vlm 0.4.3+) and of
``BatchTurboQuantKVCache`` (0.5.0+) ends with ``.astype(mx.float32)``, so a bfloat16 (or float16) model's
keys and values come back as float32. Every path that hands dense K/V on inherits it: the prefix-cache
(APC) harvest ``dequantize_for_apc`` (0.6.5+), ``apc.layer_kv_for_apc`` and the dense clones that APC
stores for TurboQuant rows (``apc.snapshot_prompt_cache_row`` in 0.6.5–0.6.17) hold float32 copies of a
bf16 model's cache: twice the memory, and the dtype drifts into the dense caches restored from them.
Uniform quantized caches keep bf16. The packed codec state itself does not record the input dtype (its
norms are float16 for every input dtype).

Measured (Linux, mlx[cpu]): bf16 and fp16 in, float32 out in 0.4.3, 0.4.4, 0.5.0, 0.6.3, 0.6.4, 0.6.15,
0.6.16, 0.7.6, 0.7.8 and 0.7.10 (the lower edge 0.4.2 has no ``mlx_vlm.turboquant``; the class comes
with git 3f133c78, #858). Not fixed upstream as of 0.7.10; not reported upstream.

Fix: deltas around the originals. ``update_and_fetch`` of both caches first notes the dtypes of the keys
and values it is fed (one attribute store per call, no host synchronisation); ``dequantize`` runs the
original and casts its float32 result to the noted dtypes, so the numbers are the original's rounded
once to the model's dtype (the dense attention fallback casts to the query dtype anyway, so attention
is unchanged). ``BatchTurboQuantKVCache.extract`` (0.6.5+), which hands a single row to the APC
without an update, passes the noted dtypes on to the row it returns. ``dequantize_for_apc`` calls
``dequantize`` and needs no change. A cache that has never been fed (restored from a packed snapshot or
from ``state``) keeps upstream's float32 until its next update.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _dtypes, _reproduce
from kvpatch.patches._numbers import exact
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="tq-dequantize-dtype",
    summary="TurboQuant dequantize() returns float32 for bf16/fp16 caches: APC harvests twice the bytes",
    distribution="mlx-vlm",
    affected=">=0.4.3,<=0.7.10",
    checked_through="0.7.10",
    introduced_commit="3f133c78",
    reference="not reported upstream",
    catalogue="V30",
    hot_path=True,
    expiry=Expiry(
        "retire when mlx-vlm's TurboQuant dequantize() returns the dtype the cache was fed "
        "(the reproduction then finds the bug absent)",
        review_by=_dt.date(2027, 3, 1),
    ),
)


PATCH.replace("mlx_vlm.turboquant", "BatchTurboQuantKVCache.update_and_fetch", optional=True)(_dtypes.noting)
PATCH.replace("mlx_vlm.turboquant", "TurboQuantKVCache.update_and_fetch")(_dtypes.noting)


@PATCH.replace("mlx_vlm.turboquant", "TurboQuantKVCache.dequantize")
@PATCH.replace("mlx_vlm.turboquant", "BatchTurboQuantKVCache.dequantize", optional=True)
def _build_dequantize(original: Any) -> Any:
    def dequantize(self: Any, keys_state: Any = None, values_state: Any = None) -> Any:
        keys, values = original(self, keys_state, values_state)
        dtypes = getattr(self, _dtypes.DTYPES, None)
        if dtypes is not None:
            keys, values = keys.astype(dtypes[0]), values.astype(dtypes[1])
        return keys, values

    return dequantize


@PATCH.replace("mlx_vlm.turboquant", "BatchTurboQuantKVCache.extract", optional=True)
def _build_extract(original: Any) -> Any:
    def extract(self: Any, idx: int) -> Any:
        row = original(self, idx)
        dtypes = getattr(self, _dtypes.DTYPES, None)
        if dtypes is not None:
            setattr(row, _dtypes.DTYPES, dtypes)
        return row

    return extract


@PATCH.reproduce
def reproduce() -> Finding:
    """Feed each TurboQuant cache bf16, fp16 and float32 keys/values; ``dequantize`` (and
    ``dequantize_for_apc`` / ``extract(0)`` where present) must return the dtype fed, with the codec's
    float32 reconstruction rounded once to that dtype."""
    import mlx.core as mx

    try:
        from mlx_vlm import turboquant
    except ImportError as exc:
        return _reproduce.absent(exc, "this mlx-vlm has no TurboQuant caches")

    mx.random.seed(0)
    H, D = 2, 32
    classes = [("TurboQuantKVCache", lambda: turboquant.TurboQuantKVCache(bits=4))]
    batch = getattr(turboquant, "BatchTurboQuantKVCache", None)
    if batch is not None:
        classes.append(("BatchTurboQuantKVCache", lambda: batch([0], bits=4)))
    problems = []
    for name, make in classes:
        for dtype in (mx.bfloat16, mx.float16, mx.float32):
            cache = make()
            for n in (3, 1):
                cache.update_and_fetch(
                    mx.random.normal((1, H, n, D)).astype(dtype), mx.random.normal((1, H, n, D)).astype(dtype)
                )
            state = cache.state
            expected = (cache.key_codec.dequantize(state[0]), cache.value_codec.dequantize(state[1]))
            paths = [("dequantize()", cache.dequantize)]
            if hasattr(cache, "dequantize_for_apc"):
                paths.append(("dequantize_for_apc()", cache.dequantize_for_apc))
            if hasattr(cache, "extract"):
                paths.append(("extract(0).dequantize_for_apc()", lambda c=cache: c.extract(0).dequantize_for_apc()))
            fed = str(dtype).split(".")[-1]
            wrong: dict[str, list[str]] = {}
            for label, call in paths:
                out = call()
                got = "/".join(sorted({str(a.dtype).split(".")[-1] for a in out}))
                if got != fed:
                    wrong.setdefault(got, []).append(label)
                elif not exact(list(out), [e.astype(dtype) for e in expected]):
                    problems.append(f"{name} {label}: numbers differ from the codec's output rounded to {fed}")
            problems += [f"{name} fed {fed}: {', '.join(labels)} return {got}" for got, labels in wrong.items()]
    if problems:
        return Finding(True, "; ".join(problems))
    return Finding(
        False, "bf16/fp16/float32 in, same dtype out on every dequantize path; numbers: codec output rounded once"
    )
