"""tq-prefix-snapshot (V31) beyond its reproduction:

* the single-row ``TurboQuantKVCache`` keeps the mixin's own snapshot/restore/reserve (the patch is
  installed on the batch class only);
* the APC's own consumers round-trip a left-padded bf16 batch cache: the disk tier
  (``DiskBlockStore.save_exact_cache`` / ``load_exact_cache``) and the in-memory ``CheckpointAdapter``;
  the restored cache decodes exactly like the original;
* an empty batch cache round-trips too.
"""

from __future__ import annotations

import inspect

import pytest

from kvpatch.patches.mlx_vlm.tq_prefix_snapshot import PATCH

pytestmark = pytest.mark.requires_patch(PATCH.id)


def _batch(dtype_name="bfloat16", left_padding=(2, 0), tokens=6):
    import mlx.core as mx
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    mx.random.seed(0)
    dtype = getattr(mx, dtype_name)
    cache = BatchTurboQuantKVCache(list(left_padding), bits=4)
    if tokens:
        shape = (len(left_padding), 2, tokens, 32)
        cache.update_and_fetch(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
    return cache


def _decode(cache):
    import mlx.core as mx

    mx.random.seed(1)
    rows = cache.left_padding.shape[0]
    k, v, q = (mx.random.normal((rows, 2, 1, 32)).astype(mx.bfloat16) for _ in range(3))
    keys, values = cache.dequantize(*cache.update_and_fetch(k, v))
    mask = mx.arange(keys.shape[-2])[None, None, None, :] >= cache.left_padding[:, None, None, None]
    return mx.fast.scaled_dot_product_attention(
        q, keys.astype(q.dtype), values.astype(q.dtype), scale=32**-0.5, mask=mask
    ).astype(mx.float32)


def _same(restored, original):
    import mlx.core as mx

    assert restored._idx == original._idx
    assert restored.offset.tolist() == original.offset.tolist()
    assert restored.left_padding.tolist() == original.left_padding.tolist()
    assert mx.array_equal(_decode(restored), _decode(original)).item()


def test_single_row_class_keeps_the_mixin_methods():
    from mlx_vlm import turboquant

    mixin = turboquant._TurboQuantAttentionMixin
    for name in ("prefix_cache_snapshot", "prefix_cache_restore", "prefix_cache_reserve"):
        assert name not in vars(turboquant.TurboQuantKVCache)
        assert getattr(turboquant.TurboQuantKVCache, name) is getattr(mixin, name)


def test_disk_tier_round_trip(tmp_path):
    from mlx_vlm import apc

    if "synchronous" not in inspect.signature(apc.DiskBlockStore.save_exact_cache).parameters:
        # 0.7.0 snapshots on its writer thread, which cannot evaluate arrays here ("There is no
        # Stream(cpu, 0) in current thread"); a plain KVCache fails the same way
        pytest.skip("this mlx-vlm's disk tier only snapshots on its writer thread")
    cache = _batch()
    store = apc.DiskBlockStore(tmp_path)
    try:
        assert store.save_exact_cache(123, list(range(6)), 0, [cache], synchronous=True)
        loaded = store.load_exact_cache(123, min_capacity_tokens=cache._idx + 4)
    finally:
        store.close()
    assert loaded is not None
    (restored,) = loaded[2]
    assert type(restored) is type(cache)
    _same(restored, cache)


def test_checkpoint_adapter_round_trip():
    from mlx_vlm.apc_adapters import CheckpointAdapter

    cache = _batch(left_padding=(0, 3, 1))
    adapter = CheckpointAdapter()
    fragment = adapter.capture(cache, prefix_len=cache._idx)
    assert fragment is not None
    restored = type(cache).__new__(type(cache))
    adapter.restore(restored, fragment, min_capacity_tokens=cache._idx + 300)
    _same(restored, cache)


def test_empty_cache_round_trip():
    cache = _batch(left_padding=(1, 0), tokens=0)
    restored = type(cache).__new__(type(cache))
    restored.prefix_cache_restore(cache.prefix_cache_snapshot())
    assert restored.empty() and restored._idx == 0
    _same(restored, cache)
