"""How kvpatch compares numbers: the one vocabulary of its reproductions, its tests and its bug hunt.

Two kinds of comparison, never mixed:

- Data that is only moved (cache slices, offsets, masks, shapes, dtypes) is the same or not: :func:`exact`.
- Computed results (attention, logits) reached two ways (batched and alone, cached and uncached, patched and a
  reference) differ by the arithmetic's rounding, which depends on the dtype and the backend: CPU float32
  (u = 2^-24), float32 on a GPU through TF32 (u = 2^-11), float16 (2^-11), bfloat16 (2^-8). :func:`difference`
  measures the largest difference together with the rounding allowed at the magnitude compared, and a verdict is
  judged against the bug's size (:func:`judge`): the bug is *present* only when the difference is clearly (:data:`CLEAR`
  times) above the rounding, *absent* when it is within it, and neither in between.

A reproduction that checks structure too (offsets, shapes, a raised error) says "present" for a wrong structure
whatever the numbers (``judge(..., problems=...)``). A test asserts ``d.within`` for "the same result" and
``not d.within`` for "a different result" (a test shows behaviour; only a verdict needs the bug to be clear).

No literal threshold anywhere else: tests/engine/test_numbers_lint.py fails on one in a unit or a test.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpatch.record import Finding

#: Unit roundoff (half an ulp at 1) of the arithmetic a result is computed in, by :func:`arithmetic`'s name.
ROUNDOFF = {"float32": 2.0**-24, "tf32": 2.0**-11, "float16": 2.0**-11, "bfloat16": 2.0**-8}

#: How many unit roundoffs, relative to the magnitude compared, two computations of one result may differ by on the
#: test models (hidden 64, sums of 64 to 128 terms, two layers). Measured on the CPU (docs/platforms.md): every
#: patched reproduction differed by exactly 0 (``scripts/margins.py``: both sides run the same operations in the same
#: order); the tests' comparisons (batched against alone, merged against per-row) by up to 9.7 u in float32 (rows
#: decoded through TurboQuant caches: tests/upstream/test_e2e_vlm.py, test_empty_tq_rows.py) and 7.1 u in bfloat16
#: (test_hybrid_quant_dtype.py); an H100's TF32 by up to 3 u. 32 leaves a factor of 3 over the largest, and keeps
#: every bug measured (0.1 and up) far above :data:`CLEAR` times the CPU's rounding.
SPREAD = 32

#: A difference counts as the bug only this many times above the rounding; between the rounding and this the
#: measurement tells neither (an "inconclusive" verdict, never a "NOT fixed" one). On the CPU every bug measured by a
#: reproduction is 5e4 to 7e5 times the rounding (``scripts/margins.py``).
CLEAR = 10


def arithmetic(dtype: object = None) -> str:
    """The arithmetic mlx's matmuls use for ``dtype`` (default float32) on the default device.

    float32 on a GPU goes through TF32 (10 stored mantissa bits) unless ``MLX_ENABLE_TF32=0`` (mlx's default is on):
    CUDA's cuBLAS and CUTLASS matmuls always; Metal only on GPUs with neural accelerators (mlx's "NAX" kernels),
    older Apple GPUs compute float32 in float32, for which the TF32 rounding assumed here is the coarser, safe side.
    On the CPU it is float32. bfloat16 and float16 are what they are.
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
    """True when two arrays (or plain values, or sequences of them: a quantized triple) are the same data: shape,
    dtype and every element."""
    import mlx.core as mx

    if isinstance(got, mx.array) or isinstance(want, mx.array):
        if not (isinstance(got, mx.array) and isinstance(want, mx.array)):
            return False
        return got.shape == want.shape and got.dtype == want.dtype and bool(mx.array_equal(got, want).item())
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(exact(a, b) for a, b in zip(got, want, strict=True))
    return bool(got == want)


@dataclass(frozen=True)
class Difference:
    """The largest difference between two computed results, the rounding allowed for them, and (``where``) what was
    compared, for a finding's detail."""

    error: float
    rounding: float
    where: str = ""

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
        """Clearly not the same result: more than :data:`CLEAR` times the rounding (NaN included)."""
        return self.ratio > CLEAR

    def __str__(self) -> str:
        where = f"{self.where}: " if self.where else ""
        return f"{where}{self.error:.3g} (rounding {self.rounding:.2g}, {self.ratio:.3g}x)"


def difference(got: Any, want: Any, dtype: object = None, *, shift_free: bool = False, where: str = "") -> Difference:
    """The largest ``|got - want|`` of two mlx arrays, with the rounding at the magnitude of ``want``.

    ``dtype``: the arithmetic's dtype (default ``want``'s). ``shift_free``: measure the magnitude of ``want`` less its
    mean along the last axis, for log-probabilities (logits less their logsumexp: the shift makes them large, of order
    log(vocabulary), while their rounding errors are the logits'). A shape mismatch raises ``ValueError``: it is a
    structural difference, which the caller states (a reproduction's ``problems``).
    """
    import mlx.core as mx

    if got.shape != want.shape:
        raise ValueError(f"comparing arrays of shapes {got.shape} and {want.shape}")
    dtype = want.dtype if dtype is None else dtype
    if not want.size:
        return Difference(0.0, rounding(dtype), where)
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    # the same non-finite value on both sides (a fully masked row's NaN, an inf) is no difference; anywhere else
    # a NaN makes the error NaN, which no rounding explains
    same = (got == want) | (mx.isnan(got) & mx.isnan(want))
    error = mx.where(same, 0.0, mx.abs(got - want)).max().item()
    magnitude = want - mx.mean(want, axis=-1, keepdims=True) if shift_free else want
    scale = mx.where(mx.isfinite(magnitude), mx.abs(magnitude), 0.0).max().item()
    return Difference(error, rounding(dtype, scale), where)


def worst(differences: Iterable[Difference]) -> Difference | None:
    """The difference furthest above its rounding (None for none)."""
    return max(differences, key=lambda d: d.ratio, default=None)


def judge(found: Difference | None, present: str, absent: str, *, problems: Sequence[str] = ()) -> Finding:
    """The finding of a reproduction whose symptom is a computed difference (``found``, the worst; None: none was
    measured): the bug when ``problems`` (structural ones: a wrong offset, a raised error) name it or the difference is
    clear, its absence when there are none and the difference is within the rounding, inconclusive in between.
    ``present`` / ``absent``: what was compared, for the detail; the sizes are appended, and kept on the finding where
    the difference decides (not where a structural problem alone makes the bug present)."""
    # the sizes of the difference that decides (a structural problem decides alone: then none are kept)
    decides = found is not None and (found.clear or not problems)
    sizes: dict[str, Any] = {"error": found.error, "rounding": found.rounding} if decides and found else {}
    if problems or (found is not None and found.clear):
        shown = [*problems, f"{present}: {found}"] if found is not None and found.clear else list(problems)
        return Finding(True, "; ".join(shown), **sizes)
    if found is None or found.within:
        return Finding(False, absent if found is None else f"{absent}: {found}", **sizes)
    between = f"{present} by {found}: above the rounding but not {CLEAR}x above it, so neither the bug nor its absence"
    return Finding(False, between, inconclusive=between, **sizes)
