"""How kvpatch compares numbers: the one vocabulary of its reproductions, its tests and its bug hunt.

Two kinds of comparison, never mixed:

- Data that is only moved (cache slices, offsets, masks, shapes, dtypes) is the same or not: :func:`exact`.
- Computed results (attention, logits) reached two ways (batched and alone, cached and uncached, patched and a
  reference) differ by the arithmetic's rounding, which depends on the dtype and the backend: CPU float32
  (u = 2^-24), float32 on a GPU through TF32 (u = 2^-11), float16 (2^-11), bfloat16 (2^-8). :func:`difference`
  measures the largest difference together with the rounding allowed at the magnitude compared, and a verdict is
  judged against the bug's size (:func:`judge`): the bug is *present* only when the difference is clearly (:data:`CLEAR`
  times) above the rounding, *absent* when it is within it, and neither in between.

No literal threshold anywhere else: a test (tests/engine/test_numbers_lint.py) fails on one in a unit or a test.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvpatch.record import Finding

#: Unit roundoff (half an ulp at 1) of the arithmetic a result is computed in, by :func:`arithmetic`'s name.
ROUNDOFF = {"float32": 2.0**-24, "tf32": 2.0**-11, "float16": 2.0**-11, "bfloat16": 2.0**-8}

#: How many unit roundoffs, relative to the magnitude compared, two computations of one result may differ by on the
#: test models (hidden 64, sums of 64 to 128 terms, two layers): an H100's TF32 measured up to 3 u between two ways of
#: computing the same logits.
SPREAD = 8

#: A difference counts as the bug only this many times above the rounding; between the rounding and this the
#: measurement tells neither (an "inconclusive" verdict, never a "NOT fixed" one).
CLEAR = 10


def arithmetic(dtype: object = None) -> str:
    """The arithmetic mlx's matmuls use for ``dtype`` (default float32) on the default device.

    float32 on a GPU (CUDA, Metal) goes through TF32 (10 stored mantissa bits) unless ``MLX_ENABLE_TF32=0`` (mlx's
    default is on); on the CPU it is float32. bfloat16 and float16 are what they are.
    """
    import mlx.core as mx

    dtype = mx.float32 if dtype is None else dtype
    if dtype == mx.bfloat16:
        return "bfloat16"
    if dtype == mx.float16:
        return "float16"
    gpu = mx.default_device().type == mx.DeviceType.gpu
    return "tf32" if gpu and os.environ.get("MLX_ENABLE_TF32", "1") != "0" else "float32"


def rounding(dtype: object = None, scale: float = 1.0) -> float:
    """How far two computations of one result in ``dtype`` on this backend may differ, at magnitude ``scale``:
    ``SPREAD u max(1, scale)`` (rounding errors are relative: logits of magnitude 10 carry ten times the error of
    values of magnitude 1)."""
    return SPREAD * ROUNDOFF[arithmetic(dtype)] * max(1.0, scale)


def exact(got: Any, want: Any) -> bool:
    """True when two arrays (or plain values) are the same data: shape, dtype and every element."""
    import mlx.core as mx

    if isinstance(got, mx.array) or isinstance(want, mx.array):
        if not (isinstance(got, mx.array) and isinstance(want, mx.array)):
            return False
        return got.shape == want.shape and got.dtype == want.dtype and bool(mx.array_equal(got, want).item())
    return bool(got == want)


@dataclass(frozen=True)
class Difference:
    """The largest difference between two computed results, and the rounding allowed for them."""

    error: float
    rounding: float

    @property
    def ratio(self) -> float:
        """The difference in units of the rounding (infinite for NaN: no rounding makes a NaN)."""
        if math.isnan(self.error):
            return math.inf
        return self.error / self.rounding

    @property
    def within(self) -> bool:
        """The same result, up to rounding."""
        return self.ratio <= 1

    @property
    def clear(self) -> bool:
        """Clearly not the same result: :data:`CLEAR` times the rounding or more (NaN included)."""
        return self.ratio > CLEAR

    def __str__(self) -> str:
        return f"{self.error:.3g} (rounding {self.rounding:.2g}, {self.ratio:.3g}x)"


NONE = Difference(0.0, 1.0)  # no difference measured (the identity of :func:`worst`)


def difference(got: Any, want: Any, dtype: object = None, *, shift_free: bool = False) -> Difference:
    """The largest ``|got - want|`` of two mlx arrays, with the rounding at the magnitude of ``want``.

    ``dtype``: the arithmetic's dtype (default ``want``'s). ``shift_free``: measure the magnitude of ``want`` less its
    mean along the last axis, for log-probabilities (logits less their logsumexp: the shift makes them large, of order
    log(vocabulary), while their rounding errors are the logits').
    """
    import mlx.core as mx

    if got.shape != want.shape:
        raise ValueError(f"comparing arrays of shapes {got.shape} and {want.shape}")
    error = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    dtype = want.dtype if dtype is None else dtype
    magnitude = want - mx.mean(want, axis=-1, keepdims=True) if shift_free else want
    return Difference(error, rounding(dtype, mx.abs(magnitude.astype(mx.float32)).max().item()))


def worst(differences: Iterable[Difference]) -> Difference:
    """The difference furthest above its rounding (:data:`NONE` for none)."""
    return max(differences, key=lambda d: d.ratio, default=NONE)


def judge(found: Difference, present: str, absent: str) -> Finding:
    """The finding of a reproduction whose symptom is a computed difference (``found``, the worst): the bug only when
    it is clear, its absence when it is within the rounding, inconclusive in between. ``present`` / ``absent``: what
    was compared, for the detail; the sizes are appended and kept on the finding."""
    sizes = {"error": found.error, "rounding": found.rounding}
    if found.clear:
        return Finding(True, f"{present}: {found}", **sizes)
    if found.within:
        return Finding(False, f"{absent}: {found}", **sizes)
    between = f"{present} by {found}: above the rounding but not {CLEAR}x above it, so neither the bug nor its absence"
    return Finding(False, between, inconclusive=between, **sizes)
