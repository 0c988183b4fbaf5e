"""tq-value-kernels-metal (M3) on a backend without Metal: the patched functions take upstream's einsum path
for Hadamard codecs and keep the kernel path for dense ones, with the same numbers as the unpatched CPU path.

The Metal value kernels cannot run here. To show what the unpatched wrappers do with a kernel result,
the kernel factories are replaced by an emulation of the kernels' documented output (the
attention-weighted sum of the codebook values in the codec's rotated space, ``weighted_rot``); the
emulation is checked against upstream's own einsum path on a dense-rotation codec, where the unpatched
wrappers are correct, before it is used on a Hadamard codec.
"""

from __future__ import annotations

import pytest

import kvpatch
from kvpatch.patches.mlx_vlm.tq_value_kernels_metal import PATCH, measure
from kvpatch.testing import difference, exact, without

pytestmark = pytest.mark.requires_patch(PATCH.id, needed=True)


def _installed() -> bool:
    return bool(kvpatch.get_engine().status[PATCH.id].installed)


@pytest.fixture
def tq():
    from mlx_vlm import turboquant

    if turboquant._metal_available():
        pytest.skip("Metal is available: the reproduction itself measures the real kernels")
    turboquant._unpack_lowbit_kernel()  # cache its CPU answer (None) before Metal is faked below
    return turboquant


class Emulation:
    """Pretend Metal is there, with the value-kernel factories returning emulations; record their use.
    Only active inside ``with emulation:`` (codecs are built and quantized outside it, on the CPU path)."""

    def __init__(self, tq):
        self.tq = tq
        self.used: list[str] = []
        self._patch = None

    def _weighted_rot(self, inputs, template, scores_form):
        import mlx.core as mx

        t = dict(template)
        first, norms, indices, codebook = inputs[:4]
        weights = mx.exp(first - inputs[4][..., None]) if scores_form else first
        unpacked = self.tq._unpack_lowbit(indices, t["Bits"], t["Dim"]).astype(mx.int32)
        values = mx.take(codebook, unpacked, axis=0)
        return [mx.einsum("bhrt,bht,bhtd->bhrd", weights, norms.astype(mx.float32), values)]

    def _factory(self, name, scores_form):
        def make(*_):
            self.used.append(name)
            return lambda inputs, template, **_: self._weighted_rot(inputs, template, scores_form)

        return make

    def __enter__(self):
        self._patch = pytest.MonkeyPatch()
        m, tq = self._patch, self.tq
        m.setattr(tq, "_metal_available", lambda: True)
        m.setattr(tq, "_unpack_lowbit_kernel", lambda: None)
        m.setattr(tq, "_mse_weighted_rot_kernel", self._factory("weighted_rot", False))
        m.setattr(tq, "_mse_weighted_rot_repeat_kernel", self._factory("weighted_rot_repeat", False))
        m.setattr(tq, "_mse_scores_weighted_rot_sum_repeat_kernel", self._factory("scores_sum_repeat", True))
        return self

    def __exit__(self, *exc):
        self._patch.undo()


@pytest.fixture
def emulation(tq):
    return Emulation(tq)


def _codec_case(tq, dim, repeats):
    """A codec, a one-query score tensor (B, H, R, 1, T) and a value state."""
    import mlx.core as mx

    mx.random.seed(dim + repeats)
    codec = tq._TurboQuantMSECodec(dim, 4, tq.DEFAULT_TURBOQUANT_SEED)
    state = codec.quantize(mx.random.normal((1, 2, 9, dim)))
    scores = mx.random.normal((1, 2, repeats, 1, 9))
    return codec, state, scores


def _outputs(codec, state, scores):
    import mlx.core as mx

    stats = codec.weighted_sum_stats_from_scores(scores, state)
    plain = codec.weighted_sum(mx.softmax(scores, axis=-1), state)
    return stats[0] / stats[1][..., None], plain


def test_use_rht_is_exactly_power_of_two(tq):
    """The patch's premise: in these releases an MSE codec uses RHT exactly when its dim is a power of two."""
    for dim in (16, 48, 64, 80):
        codec = tq._TurboQuantMSECodec(dim, 4, tq.DEFAULT_TURBOQUANT_SEED)
        assert codec.use_rht == (dim & (dim - 1) == 0), dim
        assert codec.rotation.shape == (dim, dim)


@pytest.mark.parametrize("repeats", [1, 2])
def test_reference_is_the_cpu_path(tq, repeats):
    """Without kernels (this backend), patched and unpatched give identical numbers."""
    codec, state, scores = _codec_case(tq, 64, repeats)
    patched = _outputs(codec, state, scores)
    with without(PATCH.id):
        unpatched = _outputs(codec, state, scores)
    for a, b in zip(patched, unpatched, strict=True):
        assert exact(a, b)


@pytest.mark.parametrize("repeats", [1, 2])
def test_emulation_is_faithful_on_a_dense_codec(tq, emulation, repeats):
    """Dense rotation (dim 80): the kernel path (emulated) equals the einsum path, patched or not."""
    codec, state, scores = _codec_case(tq, 80, repeats)
    reference = _outputs(codec, state, scores)
    for ctx in ("patched", "unpatched"):
        emulation.used.clear()
        if ctx == "patched":
            with emulation:
                got = _outputs(codec, state, scores)
        else:
            with without(PATCH.id), emulation:
                got = _outputs(codec, state, scores)
        assert emulation.used, f"{ctx}: the kernel path was not taken for a dense codec"
        for a, b in zip(got, reference, strict=True):
            found = difference(a, b, where=ctx)
            assert found.within, found


@pytest.mark.parametrize("repeats", [1, 2])
def test_hadamard_codec_takes_the_einsum_path(tq, emulation, repeats):
    """RHT (dim 64): patched, no kernel is consulted and the result is the einsum path's; unpatched, the
    kernel path is taken and its dense inverse gives an uncorrelated result."""
    codec, state, scores = _codec_case(tq, 64, repeats)
    assert codec.use_rht
    reference = _outputs(codec, state, scores)
    if _installed():
        with emulation:
            got = _outputs(codec, state, scores)
        assert emulation.used == [], f"patched code consulted {emulation.used}"
        for a, b in zip(got, reference, strict=True):
            assert exact(a, b)
    emulation.used.clear()
    with without(PATCH.id), emulation:
        got = _outputs(codec, state, scores)
    assert emulation.used, "unpatched code did not take the kernel path"
    found = [difference(a, b, where="unpatched emulated kernel path") for a, b in zip(got, reference, strict=True)]
    assert all(d.clear for d in found), [str(d) for d in found]


def test_measure_runs_and_is_clean_here(tq):
    finding = measure()
    assert finding.bug == "absent", (finding.bug, finding.detail, finding.inconclusive)
