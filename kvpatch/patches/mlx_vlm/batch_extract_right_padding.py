"""batch-extract-right-padding-vlm: mlx-vlm's own batch caches' ``extract`` copies pending right padding into the row.

Broken: the bug of ``batch-extract-right-padding`` (mlx-lm) in mlx-vlm's own copies: ``extract(idx)`` of
``mlx_vlm.models.cache.BatchKVCache`` and ``BatchRotatingKVCache`` (0.6.4+) and ``BatchQuantizedKVCache``
(``extract`` from 0.6.5), called after ``prepare(right_padding=..., lengths=...)`` and before ``finalize()``,
copies the pad tokens already written at the row's tail and counts them. Measured (Linux, mlx[cpu],
``KVPATCH=off``): rows of 3 and 5 tokens padded to 5, ``extract(0)`` after the 5 columns (one chunk or 3 + 2)
holds 5 positions with ``offset = 5`` instead of 3, in all three classes, on 0.6.4 (dense and rotating;
the quantized class has no ``extract`` there), 0.6.5 and 0.7.10. Not fixed as of 0.7.10 (nor on mlx-vlm main
of Aug 2026). Before 0.6.4 mlx-vlm re-exports mlx-lm's ``BatchKVCache`` / ``BatchRotatingKVCache``: those are
``batch-extract-right-padding``'s business, and this patch leaves them as they are (``own_classes_only``).

How users meet it: mlx-vlm's batched prefill (``generate/ar.py``) declares right padding at batch creation and
spreads the prefill over scheduler steps, finishing short rows at chunk boundaries; its APC checkpoints extract
a row (``snapshot_prompt_cache_row``) when the row's real tokens are done, which is before any of its pads are
written: upstream is right there, and this patch keeps it right (a fix that assumed every declared pad was
written would cut those checkpoints short). Code that extracts a row later in the prefill (a row handed to
another scheduler, a prompt-cache store after the last chunk but before ``finalize``) gets the pads.

Fix: the same deltas as the mlx-lm patch (``kvpatch/patches/_right_padding.py``): after the original ``extract``, the
row's pads written so far are cut from the tail of the single-row cache it returns; ``BatchKVCache`` and
``BatchQuantizedKVCache`` get a ``prepare`` delta that keeps ``offset + lengths`` (they drop ``lengths``) and a
``filter`` delta that filters it with the rows. The rotating class counts from its own ``_lengths``. None of
these runs per token. ``BatchQuantizedKVCache`` targets are skipped where the class has no ``extract``.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch import record
from kvpatch.patches import _pending, _right_padding
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="batch-extract-right-padding-vlm",
    summary="mlx-vlm batch cache extract() during a right-padded prefill copies the pad tokens into the row's cache",
    distribution="mlx-vlm",
    affected=">=0.6.4,<=0.7.10",
    checked_through="0.7.10",
    catalogue="N2 (mlx-vlm's copies)",
    own_classes_only=True,
    reference="not reported upstream (mlx-lm twin: ml-explore/mlx-lm#1746, closed unmerged)",
    expiry=Expiry(
        "retire when mlx-vlm's batch caches' extract leave pending right padding out (set fixed_in then) and "
        "kvpatch stops supporting the releases before",
        review_by=_dt.date(2027, 3, 1),
    ),
)


def own_class(name: str) -> Any:
    """mlx-vlm's own class ``name`` with an ``extract``, or None (absent, re-exported from mlx-lm, or no extract)."""
    import mlx_vlm.models.cache as vlm_cache

    cls = record.own_class(vlm_cache, name)
    return cls if hasattr(cls, "extract") else None


def _with_extract(name: str, build: Any) -> Any:
    def builder(original: Any) -> Any:
        import mlx_vlm.models.cache as vlm_cache

        if not hasattr(getattr(vlm_cache, name), "extract"):
            return original  # no extract here: nothing of this patch's to fix
        return build(original)

    return builder


_DENSE = _right_padding.extract_without_pending(_right_padding.dense_pending)
_ROTATING = _right_padding.extract_without_pending(_right_padding.rotating_pending)

for _name in ("BatchKVCache", "BatchQuantizedKVCache"):
    PATCH.replace("mlx_vlm.models.cache", f"{_name}.prepare", optional=True)(
        _with_extract(_name, _right_padding.record_ends)
    )
    PATCH.replace("mlx_vlm.models.cache", f"{_name}.filter", optional=True)(
        _with_extract(_name, _pending.filter_pending(_right_padding.ENDS))
    )
    PATCH.replace("mlx_vlm.models.cache", f"{_name}.extract", optional=True)(_with_extract(_name, _DENSE))
PATCH.replace("mlx_vlm.models.cache", "BatchRotatingKVCache.extract", optional=True)(
    _with_extract("BatchRotatingKVCache", _ROTATING)
)


def classes() -> dict[str, tuple[Any, Any]]:
    """``name: (make_batch(rows), make_alone())`` for mlx-vlm's own batch classes with ``extract`` here."""
    import mlx_vlm.models.cache as vlm_cache

    found: dict[str, tuple[Any, Any]] = {}
    if (cls := own_class("BatchKVCache")) is not None:
        found["BatchKVCache"] = (lambda n, c=cls: c([0] * n), vlm_cache.KVCache)
    if (cls := own_class("BatchRotatingKVCache")) is not None:
        found["BatchRotatingKVCache"] = (lambda n, c=cls: c(16, [0] * n), lambda: vlm_cache.RotatingKVCache(16))
    if (cls := own_class("BatchQuantizedKVCache")) is not None and hasattr(cls, "prepare"):
        found["BatchQuantizedKVCache"] = (
            lambda n, c=cls: c([0] * n, group_size=32, bits=8),
            lambda: vlm_cache.QuantizedKVCache(group_size=32, bits=8),
        )
    return found


@PATCH.reproduce
def reproduce() -> Finding:
    """Prefill rows of 3 and 5 tokens right-padded to 5 (in one chunk, and in chunks of 3 and 2) in each of
    mlx-vlm's own batch classes, extract both rows before ``finalize()``, and compare each extracted cache with
    the row prefilled alone: offset, stored keys and the next decode step's attention output."""
    found = classes()
    if not found:
        return Finding(False, "this mlx-vlm has no batch cache of its own with extract(): nothing to fix")
    return _right_padding.extract_finding(found)
