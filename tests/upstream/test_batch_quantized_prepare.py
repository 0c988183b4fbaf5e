"""batch-quantized-prepare (V09) beyond its reproduction: chunked right-padded prefill, left padding through
prepare(), filter() while padding is pending, CacheList forwarding, and the capability checks that flip."""

from __future__ import annotations

import pytest

from kvpatch.patches.mlx_vlm.batch_quantized_prepare import PATCH

HEADS, DIM, GROUP, BITS, WIDTH = 2, 32, 32, 8, 6


pytestmark = pytest.mark.requires_patch(PATCH.id)


def _tokens(rows):
    import mlx.core as mx

    mx.random.seed(len(rows))
    return mx.random.normal((len(rows), HEADS, WIDTH, DIM))


def _left_padded(tokens, lengths):
    """The canonical layout: each row's valid tokens at the end."""
    import mlx.core as mx

    return mx.concatenate([mx.roll(tokens[i : i + 1], WIDTH - n, axis=2) for i, n in enumerate(lengths)])


def _valid(cache):
    """Per row: the dequantized valid keys and values, offset and left padding."""
    import mlx.core as mx

    k = mx.dequantize(*(p[..., : cache._idx, :] for p in cache.keys), group_size=GROUP, bits=BITS)
    v = mx.dequantize(*(p[..., : cache._idx, :] for p in cache.values), group_size=GROUP, bits=BITS)
    pads = cache.left_padding.tolist()
    return [(k[i, :, p:], v[i, :, p:]) for i, p in enumerate(pads)], cache.offset.tolist(), pads


def _same(a, b):
    import mlx.core as mx

    (rows_a, off_a, pad_a), (rows_b, off_b, pad_b) = a, b
    assert (off_a, pad_a) == (off_b, pad_b)
    for (ka, va), (kb, vb) in zip(rows_a, rows_b, strict=True):
        assert mx.array_equal(ka, kb).item() and mx.array_equal(va, vb).item()


def _reference(tokens, lengths, step=None):
    from mlx_vlm.models.cache import BatchQuantizedKVCache

    ref = BatchQuantizedKVCache([WIDTH - n for n in lengths], group_size=GROUP, bits=BITS)
    left = _left_padded(tokens, lengths)
    ref.update_and_fetch(left, -left)
    if step is not None:
        ref.update_and_fetch(step, -step)
    return ref


def test_chunked_right_padded_prefill_then_decode():
    import mlx.core as mx
    from mlx_vlm.models.cache import BatchQuantizedKVCache

    lengths = [6, 2, 4]
    tokens = _tokens(lengths)
    step = mx.random.normal((3, HEADS, 1, DIM))
    cache = BatchQuantizedKVCache([0, 0, 0], group_size=GROUP, bits=BITS)
    cache.prepare(right_padding=[WIDTH - n for n in lengths], lengths=lengths)
    cache.update_and_fetch(tokens[:, :, :4], -tokens[:, :, :4])  # two prefill chunks
    cache.update_and_fetch(tokens[:, :, 4:], -tokens[:, :, 4:])
    cache.finalize()
    cache.update_and_fetch(step, -step)
    _same(_valid(cache), _valid(_reference(tokens, lengths, step)))


def test_no_right_padding_is_a_no_op():
    from mlx_vlm.models.cache import BatchQuantizedKVCache

    lengths = [WIDTH, WIDTH]
    tokens = _tokens(lengths)
    cache = BatchQuantizedKVCache([0, 0], group_size=GROUP, bits=BITS)
    cache.prepare(right_padding=[0, 0], lengths=lengths)
    cache.update_and_fetch(tokens, -tokens)
    cache.finalize()
    _same(_valid(cache), _valid(_reference(tokens, lengths)))


def test_prepare_left_padding():
    from mlx_vlm.models.cache import BatchQuantizedKVCache

    lengths = [4, 6]
    tokens = _tokens(lengths)
    cache = BatchQuantizedKVCache([0, 0], group_size=GROUP, bits=BITS)
    cache.prepare(left_padding=[2, 0])
    left = _left_padded(tokens, lengths)
    cache.update_and_fetch(left, -left)
    _same(_valid(cache), _valid(_reference(tokens, lengths)))
    with pytest.raises(ValueError):
        cache.prepare(left_padding=[1, 1])


def test_filter_while_padding_is_pending():
    import mlx.core as mx
    from mlx_vlm.models.cache import BatchQuantizedKVCache

    lengths = [6, 2, 4]
    tokens = _tokens(lengths)
    cache = BatchQuantizedKVCache([0, 0, 0], group_size=GROUP, bits=BITS)
    cache.prepare(right_padding=[WIDTH - n for n in lengths], lengths=lengths)
    cache.update_and_fetch(tokens, -tokens)
    cache.filter(mx.array([1, 2]))
    cache.finalize()
    _same(_valid(cache), _valid(_reference(tokens[1:], lengths[1:])))


def test_cache_list_forwards_to_the_quantized_cache():
    from mlx_vlm.models.cache import BatchKVCache, BatchQuantizedKVCache, CacheList

    lengths = [6, 3]
    tokens = _tokens(lengths)
    quantized = BatchQuantizedKVCache([0, 0], group_size=GROUP, bits=BITS)
    both = CacheList(quantized, BatchKVCache([0, 0]))
    both.prepare(right_padding=[WIDTH - n for n in lengths], lengths=lengths)
    quantized.update_and_fetch(tokens, -tokens)
    both.caches[1].update_and_fetch(tokens, -tokens)
    both.finalize()
    _same(_valid(quantized), _valid(_reference(tokens, lengths)))
    assert both.caches[1].left_padding.tolist() == quantized.left_padding.tolist() == [0, 3]


def test_capability_checks_see_callables():
    """What mlx-vlm's generators and drafters test (``getattr(c, "prepare", None)`` callable, ``hasattr``)."""
    from mlx_vlm.models.cache import BatchQuantizedKVCache

    cache = BatchQuantizedKVCache([0], group_size=GROUP, bits=BITS)
    for name in ("prepare", "finalize"):
        assert callable(getattr(cache, name, None)) and hasattr(cache, name)
