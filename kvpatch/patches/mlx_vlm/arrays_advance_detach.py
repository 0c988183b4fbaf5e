"""vlm-arrays-advance-detach: mlx-vlm's own ArraysCache.advance grows lazy left_padding/lengths graphs.

Broken: from 0.6.4 (git a492e47d, #1494) mlx-vlm carries its own ``mlx_vlm.models.cache.ArraysCache``
(before, it re-exported mlx-lm's, which ``arrays-advance-detach`` covers). Its ``advance(N)`` (called by
every conv / SSM / linear-attention layer of hybrid models after it stores its new state: LFM2, Qwen3.5,
Qwen3-Next, Nemotron-H, ...) decrements ``left_padding`` and ``lengths`` with ``-= N`` and nothing
evaluates them: only the one cache a model builds its SSM mask from reads ``left_padding``, and
mlx-vlm's generators evaluate ``cache.state``, which for this class is the state list alone. mlx-vlm's
BatchGenerator sets ``left_padding`` on every ArraysCache (``_make_cache``), so in every other such
layer the chain grows by 5 graph edges per decoded token without bound (on Metal one buffer per token
per layer: upstream measured ``[metal::malloc] Resource limit (499000) exceeded`` at ~10.3k tokens on a
64-layer Qwen3.5).

Measured (Linux, mlx[cpu]; advance steps with only the states evaluated): left_padding/lengths graphs
of 100 edges each after 20 steps and 1000 after 200 on 0.6.4, 0.6.5, 0.6.13, 0.6.14 and 0.6.15 (0 with
the patch); a constant 5 (the read's own subtraction) on 0.6.16, 0.7.0 and 0.7.10.

Upstream: Blaizzy/mlx-vlm#1972, fixed by 72f37ca4 (#1984) in 0.6.16, which keeps the pending decrement
as a Python int and subtracts it when the metadata is read.

Fix: the same as ``arrays-advance-detach`` (``_arrays``; its record says where the result differs from upstream's
in-place ``-=``, in each case as 0.6.16's own fix does): ``left_padding`` / ``lengths`` become data descriptors on
mlx-vlm's own class, ``advance`` stores ``(stored array, total + N)`` per attribute in one store, and a read returns
the stored array minus that total, computed afresh and stored nowhere (a pure read, as 0.6.16's); a writer's new
array drops the total; pickles and copies carry upstream's values only (``__reduce_ex__``); taking the patch out
writes every total into its attribute. Where ``mlx_vlm.models.cache`` has mlx-lm's class the engine leaves it alone
(``own_classes_only``: that class is arrays-advance-detach's). No host synchronisation; values identical.
"""

from __future__ import annotations

import datetime as _dt
import sys

from kvpatch.patches import _arrays
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="vlm-arrays-advance-detach",
    summary="mlx-vlm's own ArraysCache.advance decrements left_padding/lengths lazily and nothing evaluates them",
    distribution="mlx-vlm",
    affected=">=0.6.4,<0.6.16",
    fixed_in="0.6.16",
    fixed_commit="72f37ca4",
    introduced_commit="a492e47d",
    catalogue="N4 (mlx-vlm's copy of B3)",
    reference="Blaizzy/mlx-vlm#1984 (issue Blaizzy/mlx-vlm#1972; mlx-lm twin: arrays-advance-detach)",
    hot_path=True,
    own_classes_only=True,
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-vlm < 0.6.16",
        review_by=_dt.date(2027, 6, 1),
    ),
)


_arrays.declare_deferred(PATCH, "mlx_vlm.models.cache")
# optional: upstream's class inherits object's, which has no source to fingerprint
PATCH.replace("mlx_vlm.models.cache", "ArraysCache.__reduce_ex__", optional=True)(_arrays.pickle_upstream_values)


@PATCH.after_restore
def _flush() -> None:
    """The descriptors are gone: each cache's attribute must hold its value again, deferred decrements included."""
    if "mlx_vlm.models.cache" in sys.modules:
        cls = _arrays.vlm_own_arrays_cache()
        if cls is not None:
            _arrays.flush(cls)


@PATCH.reproduce
def reproduce() -> Finding:
    """mlx-vlm's own ArraysCache advanced 200 steps with only its states evaluated (see ``_arrays``)."""
    return _arrays.on_vlm_own_class(_arrays.advance_growth, "arrays-advance-detach")
