"""Helpers for kvpatch's own tests and for anyone checking a patch by hand.

``unpatched_decision(patch)`` is the gate's decision with the environment's switches ignored, so a test
knows whether the running upstream *should* be patched even when ``KVPATCH_DISABLE`` removed the patch
(that is how a regression test is shown to fail without its patch: run it with the patch disabled).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from . import get_engine
from .config import Config
from .detect import Upstream
from .engine import import_target_modules, run_reproduction
from .gate import Decision, decide

# How numbers are compared and the test models: the reproductions' own (they run at run time), re-exported for the
# tests.
from .patches._numbers import Difference, arithmetic, difference, exact, rounding, worst
from .patches._reproduce import tiny_llama, tiny_pixtral_language_model
from .record import Finding, Patch
from .registry import Stub

__all__ = [
    "Difference",
    "agreeing_steps",
    "arithmetic",
    "backend_gap",
    "difference",
    "exact",
    "import_targets",
    "natural_decision",
    "quantization_gap",
    "reproduce",
    "rounding",
    "same_greedy",
    "skip_on_gap",
    "tiny_llama",
    "tiny_pixtral_language_model",
    "with_and_without",
    "without",
    "worst",
]

_T = TypeVar("_T")


def natural_decision(patch: Patch | Stub) -> Decision:
    engine = get_engine()
    upstream = engine.upstream.get(patch.distribution) or Upstream(patch.distribution, None)
    return decide(patch, upstream, Config(enable_all=True))


def import_targets(patch: Patch) -> None:
    """Import the patch's target modules, so that the engine's hooks have run for them."""
    import_target_modules(patch)


@contextmanager
def without(*patch_ids: str) -> Iterator[None]:
    with get_engine().without(*patch_ids):
        yield


def with_and_without(patch_id: str, run: Callable[[], _T]) -> tuple[_T, _T]:
    """``run()`` as this process has the patch, then again with it taken out (:func:`without`)."""
    with_patch = run()
    with without(patch_id):
        return with_patch, run()


def reproduce(patch: Patch) -> Finding:
    """``run_reproduction`` for tests: a reproduction stopped by a kernel this backend lacks skips the test."""
    return skip_on_gap(run_reproduction(patch))


# -- what the backend computes, and how exactly ----------------------------------------------------------------

#: How mlx backends say they have no kernel for an operation (not a bug of upstream's code: the test cannot run).
BACKEND_GAPS = (
    "No implementation for problem shape",  # CUDA quantized_matmul / gather_qmm (mlx 0.32)
    "has no CUDA implementation",  # a primitive without a CUDA kernel (mlx 0.28-0.30)
    # a kernel mlx compiles at run time (NVRTC) and cannot compile on this host, e.g. mlx-cuda-13 0.32.4's
    # qmm_sm90_* on an H100 whose CUDA headers lack crt/mma.h (nvidia-cuda-crt, which mlx-cuda-13 does not require)
    "Failed to compile kernel",
    # a model whose upstream code calls a custom Metal kernel (mx.fast.metal_kernel) on a host without Metal, e.g.
    # mlx-vlm 0.6.0-0.6.3's qwen3_5 on Linux
    "No Metal back-end",
)


def backend_gap(text: str) -> str | None:
    """The backend's own message when ``text`` (an error or an inconclusive finding) says a kernel is missing."""
    return text if any(gap in text for gap in BACKEND_GAPS) else None


def skip_on_gap(finding: Finding) -> Finding:
    if finding.inconclusive and backend_gap(finding.inconclusive):
        import pytest

        pytest.skip(f"the {_backend()} backend lacks a kernel: {finding.inconclusive}")
    return finding


def _backend() -> str:
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    if mx.default_device().type != mx.DeviceType.gpu:
        return "CPU"
    return "CUDA" if cuda is not None and cuda.is_available() else "Metal"


def quantization_gap(dtype: object = None) -> str | None:
    """Why a row decoded through a quantized KV cache cannot be held to the rounding (:func:`difference`) against the
    same row decoded another way (batched vs alone) here; None where it can.

    The rounding bounds a continuous effect. A quantized cache maps each key and value to a code, a discontinuous
    step: mlx-lm / mlx-vlm's affine caches (``mx.quantize``: groups of 32 or 64 values, 4 or 8 bits) round each value
    to the nearest of 2^bits levels of its group, mlx-vlm's TurboQuant maps each rotated coordinate to the nearest
    codebook entry. Inputs that differ by a rounding error (the k/v projections of one row computed in a batch and
    alone) land in different codes wherever a value lies that close to a midpoint, and each such value moves by a
    whole code step. With float32 matmuls in TF32 (:func:`arithmetic`: a GPU, unless ``MLX_ENABLE_TF32=0``) that
    happens on the test models. TurboQuant, on the CPU: keys and values perturbed by 2^-13 to 2^-11 relative before
    they reach the cache moved the logits by 0.009 to 0.04, against 7e-7 unperturbed; the H100 measured 0.021 to
    0.029 (rounding 0.0055 to 0.007). Affine, on the H100: 0.026 to 0.029 (4 bits) and 0.0088 (8 bits) against
    roundings of 0.0059 and 0.0068, where the same tests pass with ``MLX_ENABLE_TF32=0``. With float32 matmuls the
    rows quantize identical inputs. bfloat16 runs are compared at bfloat16's own, coarser rounding, which such a step
    stays within.
    """
    if arithmetic(dtype) != "tf32":
        return None
    return (
        "float32 matmuls run in TF32 on this backend (MLX_ENABLE_TF32=0 turns that off): a quantized cache "
        "(affine groups or TurboQuant's codebook) can quantize a row's keys and values into different codes "
        "batched and alone (a value within 2^-11 of a rounding midpoint), which moves logits by a whole code step, "
        "not by rounding (kvpatch.testing.quantization_gap)"
    )


def same_greedy(got: list[int], expected: list[int], scores: list[object], dtype: object = None) -> str | None:
    """None when greedy tokens ``got`` agree with ``expected``, allowing a split at a near tie; else why not.

    ``scores[i]`` is the reference's logits or log-probability vector at step ``i`` (what ``generate_step``
    yields with each token; only differences within one step are used), computed in ``dtype`` (default float32).
    Two correct computations of the same logits differ by up to :func:`rounding` at their magnitude (shift-free:
    logits and log-probabilities alike), so where the reference's two best tokens are that close, either may be
    picked, and after that the sequences may part: the tokens must be equal up to the first difference, and there
    the token ``got`` picked must be within the rounding of the reference's best. On the CPU this is plain equality
    but for ties closer than float32's rounding.
    """
    for i, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a == b:
            continue
        row = scores[i]
        gap = float(row[b].item() - row[a].item())  # type: ignore[index]
        allowed = rounding(dtype, float((row - row.mean()).abs().max().item()))  # type: ignore[attr-defined]
        if gap <= allowed:
            return None
        return f"step {i}: {a} instead of {b}, whose score is higher by {gap:.3g} (> rounding {allowed:.3g})"
    if len(got) != len(expected):
        return f"{len(got)} tokens instead of {len(expected)}"
    return None


def agreeing_steps(got: list[int], expected: list[int]) -> int:
    """How many steps two greedy runs share a context: up to and including their first differing token."""
    for i, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a != b:
            return i + 1
    return min(len(got), len(expected))


def require_affected(patch: Patch) -> Decision:
    """For tests: skip unless the installed upstream has the patch's range in play; import its targets.

    Skips (through pytest) when the distribution is absent or predates the bug; otherwise imports
    the target modules so the engine's hooks have run, and returns the natural decision.
    """
    import pytest

    from .gate import Action

    decision = natural_decision(patch)
    if decision.action in (Action.NOT_INSTALLED, Action.OUT_OF_RANGE):
        pytest.skip(f"{patch.id}: {decision.reason}")
    import_target_modules(patch)
    return decision


def require_applies(patch: Patch) -> Decision:
    """For tests of a patch's fixed behaviour: skip unless the patch applies to the installed upstream; import its
    targets. It applies by version (an index install in the affected range) or, where the reproduction decides
    (archive, editable, directory and unknown git installs), by this environment's verdict: skipped then while
    there is none, or it is inconclusive, or it says the bug is absent. A patch that applies but is switched off
    (``KVPATCH_DISABLE``) is not skipped: the test then shows what goes wrong without it.
    """
    import pytest

    from .gate import Action
    from .states import State

    decision = natural_decision(patch)
    if decision.action not in (Action.APPLY, Action.VERIFY):
        pytest.skip(f"{patch.id}: {decision.reason}")
    import_target_modules(patch)
    if decision.action is Action.VERIFY:
        st = get_engine().status[patch.id]
        if st.state in (State.UNVERIFIED, State.INCONCLUSIVE, State.NOT_NEEDED):
            pytest.skip(f"{patch.id}: the reproduction decides here, and this environment's verdict: {st.reason}")
    return decision


def skip_unless_in_place(patch_id: str, why: str) -> None:
    """For tests that rely on another patch: skip when the running upstream needs it and it is not installed
    (e.g. run with ``KVPATCH_DISABLE``), so that only that patch's own tests fail."""
    import pytest

    from .gate import Action

    st = get_engine().status.get(patch_id)
    if st is not None and natural_decision(st.patch).action is Action.APPLY and not st.installed:
        pytest.skip(f"this release also has {why} and {patch_id} is not applied")
