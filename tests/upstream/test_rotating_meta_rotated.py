"""rotating-meta-rotated / vlm-rotating-meta-rotated beyond the reproduction: a tiny random-weight model
decodes through batch rotating caches that were snapshotted (state + meta_state) and restored into fresh
caches, and must give the logits of the uninterrupted batch; both for a cache that has not wrapped
(``rotated`` False, the bug) and one that has (``rotated`` True, which the fix must keep). On mlx-lm
0.28.1 (the one release whose ``from_state`` still decodes) also through save_prompt_cache /
load_prompt_cache.
"""

from __future__ import annotations

import os
import tempfile

import pytest

from kvpatch.patches._meta_rotated import restore
from kvpatch.patches.mlx_lm.rotating_meta_rotated import PATCH as LM_PATCH
from kvpatch.patches.mlx_vlm.rotating_meta_rotated import PATCH as VLM_PATCH
from kvpatch.testing import difference, require_affected, tiny_llama

PROMPTS = [[7, 3, 22], [5, 9, 2, 33, 17]]
WINDOW = 8


def _cache_module(origin):
    if origin == "mlx_lm":
        require_affected(LM_PATCH)
        from mlx_lm.models import cache
    else:
        require_affected(VLM_PATCH)
        from mlx_vlm.models import cache

        if not cache.BatchRotatingKVCache.__module__.startswith("mlx_vlm."):
            pytest.skip("mlx-vlm re-exports mlx-lm's BatchRotatingKVCache here")
    return cache


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _prefill(model, C):
    import mlx.core as mx

    width = max(map(len, PROMPTS))
    pad = [width - len(p) for p in PROMPTS]
    caches = [C.BatchRotatingKVCache(WINDOW, pad) for _ in model.layers]
    tokens = mx.array([[0] * n + p for n, p in zip(pad, PROMPTS, strict=True)])
    model(tokens, cache=caches)
    return caches


def _decode(model, caches, steps):
    import mlx.core as mx

    return [model(mx.array([[t], [t + 1]]), cache=caches)[:, -1] for t in steps]


def _restore(C, caches):
    out = []
    for c in caches:
        fresh = C.BatchRotatingKVCache(WINDOW, [0] * len(PROMPTS))
        restore(c, fresh)
        out.append(fresh)
    return out


@pytest.mark.parametrize("origin", ["mlx_lm", "mlx_vlm"])
@pytest.mark.parametrize("warmup", [0, 6], ids=["not-rotated", "rotated"])
def test_restored_cache_decodes_like_the_original(model, origin, warmup):

    C = _cache_module(origin)
    ours, theirs = _prefill(model, C), _prefill(model, C)
    warm = list(range(10, 10 + warmup))
    _decode(model, ours, warm)
    _decode(model, theirs, warm)
    assert ours[0].rotated == (warmup > 0)
    restored = _restore(C, theirs)
    assert [c.rotated for c in restored] == [c.rotated for c in ours]
    for step, (want, got) in enumerate(
        zip(_decode(model, ours, [40, 41, 42]), _decode(model, restored, [40, 41, 42]), strict=True)
    ):
        found = difference(got, want, where=f"step {step}: the restored cache's logits")
        assert found.within, found


def test_file_round_trip_on_0_28_1(model):

    C = _cache_module("mlx_lm")
    from mlx_lm.models.cache import BatchRotatingKVCache

    ours, theirs = _prefill(model, C), _prefill(model, C)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "cache.safetensors")
        C.save_prompt_cache(path, theirs)
        loaded = C.load_prompt_cache(path)
    if any(not hasattr(c, "_lengths") for c in loaded) and "_lengths" in vars(BatchRotatingKVCache(WINDOW, [0])):
        pytest.skip("from_state leaves _lengths unset on this release (a separate bug): the file path cannot decode")
    assert [c.rotated for c in loaded] == [False, False]
    for want, got in zip(_decode(model, ours, [40, 41]), _decode(model, loaded, [40, 41]), strict=True):
        found = difference(got, want, where="the loaded cache's logits")
        assert found.within, found
