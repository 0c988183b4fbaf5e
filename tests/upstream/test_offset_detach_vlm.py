"""offset-detach-vlm (V32) beyond its reproduction: each covered mlx-vlm cache class keeps its offset graph
flat over thousands of steps, stores bit-identical contents patched vs unpatched, and mlx-vlm's
re-exported mlx-lm BatchKVCache (< 0.6.4) is left to offset-detach (not wrapped twice).
"""

from __future__ import annotations

import pytest
from _edges import growth_period, max_edges

import kvpatch
from kvpatch.gate import Action
from kvpatch.patches.mlx_vlm.offset_detach import PATCH, arrays, caches, checkpoints, graph_edges, own_batch_kv_cache
from kvpatch.testing import import_targets, natural_decision, without


@pytest.fixture(scope="module", autouse=True)
def _in_range():
    decision = natural_decision(PATCH)
    if decision.action in (Action.NOT_INSTALLED, Action.OUT_OF_RANGE, Action.NOT_NEEDED):
        pytest.skip(f"{PATCH.id}: {decision.reason}")
    import_targets(PATCH)


def _patched() -> bool:
    return bool(kvpatch.get_engine().status[PATCH.id].installed)


NAMES = ["BatchQuantizedKVCache", "BatchTurboQuantKVCache", "BatchKVCache"]


def _steps(name: str) -> int:
    return 150 if name == "BatchTurboQuantKVCache" else 3000  # TurboQuant costs 3-25 ms a step on a loaded CPU


def _checkpoints(name: str) -> tuple[int, int, int]:
    """Three checkpoints with the same pending chain on a fixed cache: the reproduction's two, and one more the same
    distance on (BatchKVCache, tied at each buffer growth); evenly spread for the classes tied every step."""
    if name != "BatchKVCache":
        steps = _steps(name)
        return steps // 3, 2 * steps // 3, steps
    first, second = checkpoints(name)
    return first, second, 2 * second - first


def _bound(name: str) -> int:
    """The most edges a fixed cache's offset graph may hold: one step's (tied every step), or a buffer's worth."""
    period = growth_period(own_batch_kv_cache()) if name == "BatchKVCache" else None
    return max_edges(period) if period else 10


def _decode(name: str, steps: int, checkpoints: tuple[int, ...] = (), dtype=None):
    """Prefill 3 tokens then decode ``steps`` tokens, evaluating only what ``update_and_fetch`` returns."""
    import mlx.core as mx

    dtype = dtype or mx.float32
    mx.random.seed(3)
    cache = caches()[name]
    prompt = mx.random.normal((2, 2, 3, 64)).astype(dtype)
    mx.eval(arrays(cache.update_and_fetch(prompt, -prompt)))
    tokens = mx.random.normal((steps, 2, 2, 1, 64)).astype(dtype)
    mx.eval(tokens)
    edges, out = {}, None
    for i in range(steps):
        out = arrays(cache.update_and_fetch(tokens[i], tokens[i] * 2))
        mx.eval(out)
        if i + 1 in checkpoints:
            edges[i + 1] = graph_edges(cache.offset)
    return cache, out, edges


def _require(name: str) -> None:
    if name not in caches():
        pytest.skip(f"{name}: mlx-vlm's own class is absent here (it re-exports mlx-lm's before 0.6.4)")


@pytest.mark.parametrize("name", NAMES)
def test_offset_graph_flat_over_many_steps(name):
    _require(name)
    steps = _steps(name)
    marks = _checkpoints(name)
    cache, _, edges = _decode(name, steps, marks)
    assert cache.offset.tolist() == [3 - 2 + steps, 3 + steps]
    assert max(edges.values()) <= _bound(name) and len(set(edges.values())) == 1, edges
    if _patched():
        with without(PATCH.id):
            _, _, grown = _decode(name, steps, marks)
        assert grown[marks[2]] - grown[marks[0]] >= 4 * (marks[2] - marks[0]), grown


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", NAMES)
def test_contents_unchanged(name, dtype_name):
    import mlx.core as mx

    _require(name)
    if not _patched():
        pytest.skip(f"{PATCH.id} is not installed in this process")
    dtype = getattr(mx, dtype_name)
    steps = 300 if name == "BatchKVCache" else 60  # BatchKVCache: past a buffer growth (where it is tied)
    cache, out, _ = _decode(name, steps, dtype=dtype)
    with without(PATCH.id):
        ref, ref_out, _ = _decode(name, steps, dtype=dtype)
    assert len(out) == len(ref_out) > 0
    for a, b in zip(out, ref_out, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()
    stored, ref_stored = arrays((cache.keys, cache.values)), arrays((ref.keys, ref.values))
    assert all(mx.array_equal(a, b).item() for a, b in zip(stored, ref_stored, strict=True))
    assert mx.array_equal(cache.offset, ref.offset).item()
    assert mx.array_equal(cache.left_padding, ref.left_padding).item()


def test_reexported_mlx_lm_class_left_to_offset_detach():
    """Before 0.6.4 mlx_vlm.models.cache.BatchKVCache is mlx-lm's class: this patch must not wrap it."""
    import mlx_lm.models.cache as lm_cache
    import mlx_vlm.models.cache as vlm_cache

    if vlm_cache.BatchKVCache.__module__.startswith("mlx_vlm."):
        pytest.skip("mlx-vlm has its own BatchKVCache here (>= 0.6.4): covered by the tests above")
    assert vlm_cache.BatchKVCache is lm_cache.BatchKVCache
    with without("offset-detach", "offset-rebind"):
        # offset-detach (and offset-rebind, same method) out: whatever this patch installed on the shared class must be upstream's own
        assert lm_cache.BatchKVCache.update_and_fetch.__module__ == "mlx_lm.models.cache"
