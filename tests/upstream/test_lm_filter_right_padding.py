"""lm-filter-right-padding (L-V10) beyond its reproduction, on mlx-lm's ``BatchKVCache`` / ``BatchRotatingKVCache``:

* three rows, ``filter()`` during the right-padded prefill (kept rows in order with an index array, and reordered
  with a Python list, as ``PromptProcessingBatch.filter`` passes it): offset, left padding, valid keys and the
  next decode step equal the kept rows prefilled alone;
* ``filter()`` with no padding pending is unchanged;
* the delta composes: stacked with ``vlm-filter-right-padding``'s delta on the same original (mlx-vlm <= 0.6.3
  re-exports these classes), in either order, or wrapped around a ``filter`` that already indexes the pending
  padding (mlx-vlm 0.6.14+), the result is the same as with one fix.
"""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_lm.filter_right_padding import PATCH, PENDING, compare, new_cache, prefill_and_decode
from kvpatch.record import Kind
from kvpatch.testing import without

CLASSES = [cls for cls, _ in PENDING]


pytestmark = pytest.mark.requires_patch(PATCH.id)


def _inputs(seed):
    import mlx.core as mx

    mx.random.seed(seed)
    return mx.random.normal((3, 2, 5, 32)), mx.random.normal((2, 2, 1, 32)), mx.random.normal((2, 2, 1, 32))


@pytest.mark.parametrize("keep", [[1, 2], [2, 0]], ids=["in-order-array", "reordered-list"])
@pytest.mark.parametrize("cls_name", CLASSES)
def test_decode_after_filter_equals_rows_alone(cls_name, keep):
    import mlx.core as mx

    keys, step, queries = _inputs(2)
    lengths = [5, 2, 3]
    indices = mx.array(keep) if keep == [1, 2] else list(keep)
    got = prefill_and_decode(cls_name, keys, lengths, indices, step, queries)
    ref = prefill_and_decode(cls_name, keys[mx.array(keep)], [lengths[i] for i in keep], None, step, queries)
    assert got["offset"] == [lengths[i] for i in keep]
    problem, found = compare(got, ref)
    assert problem is None and found is not None and found.within, (problem, found)


@pytest.mark.parametrize("cls_name", CLASSES)
def test_filter_without_pending_padding(cls_name):
    import mlx.core as mx

    mx.random.seed(4)
    cache = new_cache(cls_name, 2)
    keys = mx.random.normal((2, 2, 3, 32))
    cache.update_and_fetch(keys, keys)
    cache.filter(mx.array([1]))
    assert cache.offset.tolist() == [3] and cache.left_padding.tolist() == [0]
    assert getattr(cache, dict(PENDING)[cls_name]) is None


def _builder(patch, cls_name):
    (target,) = [t for t in patch.targets if t.qualname == f"{cls_name}.filter" and t.kind is Kind.REPLACE]
    return patch.builders[target]


def _run_with(filter_function, cls_name):
    """The reproduction's scenario with ``filter_function`` called in place of the class's ``filter``."""
    import mlx.core as mx

    keys, step, queries = _inputs(6)
    cache = new_cache(cls_name, 3)
    cache.prepare(right_padding=[5 - n for n in (5, 2, 3)], lengths=[5, 2, 3])
    cache.update_and_fetch(keys, -keys)
    filter_function(cache, mx.array([2, 1]))
    cache.finalize()
    offset, pad = cache.offset.tolist(), cache.left_padding.tolist()
    mask = cache.make_mask(1)
    k, v = cache.update_and_fetch(step, -step)
    out = mx.fast.scaled_dot_product_attention(queries, k, v, scale=32**-0.5, mask=mask)
    return offset, pad, out


@pytest.mark.parametrize("cls_name", CLASSES)
def test_composes_with_vlm_filter_right_padding(cls_name):
    import mlx.core as mx
    from mlx_lm.models import cache as cache_module

    from kvpatch.patches.mlx_vlm.filter_right_padding import PATCH as VLM

    with without(PATCH.id):
        original = getattr(cache_module, cls_name).filter
    ours, theirs = _builder(PATCH, cls_name), _builder(VLM, cls_name)
    offset, pad, out = _run_with(ours(original), cls_name)
    assert offset == [3, 2] and pad == [2, 3]
    for stacked in (theirs(ours(original)), ours(theirs(original))):
        s_offset, s_pad, s_out = _run_with(stacked, cls_name)
        assert (s_offset, s_pad) == (offset, pad)
        assert s_out.shape == out.shape and mx.abs(s_out - out).max().item() == 0


@pytest.mark.parametrize("cls_name", CLASSES)
def test_wraps_a_fixed_filter_unchanged(cls_name):
    """mlx-vlm 0.6.14+ ships these classes with a ``filter`` that indexes the pending padding (570afed3): the same
    delta around it gives what the fixed ``filter`` gives alone."""
    import importlib.metadata

    import mlx.core as mx
    from packaging.version import Version

    try:
        version = importlib.metadata.version("mlx-vlm")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("mlx-vlm is not installed: no upstream class with a fixed filter() here")
    if Version(version) < Version("0.6.14"):
        pytest.skip(f"mlx-vlm {version} has no fixed filter() (fixed in 0.6.14)")
    from mlx_vlm.models import cache as vlm_cache

    fixed = getattr(vlm_cache, cls_name).filter
    wrapped = _builder(PATCH, cls_name)(fixed)
    results = []
    for function in (fixed, wrapped):
        keys = _inputs(8)[0]
        cls = getattr(vlm_cache, cls_name)
        cache = cls(16, [0] * 3) if cls_name == "BatchRotatingKVCache" else cls([0] * 3)
        cache.prepare(right_padding=[0, 3, 2], lengths=[5, 2, 3])
        cache.update_and_fetch(keys, -keys)
        function(cache, mx.array([2, 1]))
        cache.finalize()
        results.append((cache.offset.tolist(), cache.left_padding.tolist(), cache.keys))
    assert results[0][:2] == results[1][:2] == ([3, 2], [2, 3])
    assert mx.abs(results[0][2] - results[1][2]).max().item() == 0
