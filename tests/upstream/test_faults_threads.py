"""Fault suite, threads: a second thread reading the caches while their owner decodes (a monitor, a metrics
exporter, a debugger) must not change what the owner computes. kvpatch's deferred metadata (arrays-advance-detach,
vlm-arrays-advance-detach) and growth tie (offset-detach, offset-detach-vlm) serve attributes through descriptors;
upstream's are plain attributes, whose reads are pure and never ``None`` in the middle of ``advance``.

* A reader thread polls every cache (``left_padding``, ``lengths``, ``offset``, ``step``, ``make_mask``) during a
  ``BatchGenerator`` decode of a tiny random LFM2 (short convolutions with ArraysCache, one attention layer with
  BatchKVCache) with the switch interval at 1 us: no error in either thread, no attribute seen ``None`` between two
  values, and the tokens are those of the same decode with kvpatch off (a child with ``KVPATCH=off``).
* Reading ``step`` of a batch KV cache from another thread stores nothing in the cache (mlx streams are per thread:
  an array a reader left there fails in the owner with "There is no Stream(cpu, N) in current thread").
"""

from __future__ import annotations

import json
import sys
import threading

import pytest

pytest.importorskip("mlx_lm")

SERVING = __import__("pathlib").Path(__file__).resolve().parent.parent / "serving"

#: The decode, run here (kvpatch on) and in a child (kvpatch off): the same code both sides.
DECODE = """
import json
import threading

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import BatchGenerator

# One length: mlx-lm's BatchGenerator then keeps the conv layers' left_padding (zeros) through decode on every
# release (with padding, 0.31.3 and older clear it at the end of the prefill), so advance has metadata to defer.
PROMPTS = [[5, 9, 13, 2], [21, 4, 8, 30], [44, 17, 3, 61], [7, 7, 90, 12]]
MISSING = object()


class Spy:
    '''The model as BatchGenerator sees it, keeping the cache list of its last call for the reader.'''

    def __init__(self, model):
        self.model, self.caches = model, []

    def __call__(self, *args, cache=None, **kwargs):
        self.caches = list(cache or ())
        return self.model(*args, cache=cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def poll(spy, stop, found):
    '''Read every cache's metadata until stopped; count reads, errors and "None between two values".'''
    last = {}
    while not stop.is_set():
        for cache in spy.caches:
            for name in ("left_padding", "lengths", "offset", "step"):
                try:
                    value = getattr(cache, name, MISSING)
                except Exception as exc:
                    found["errors"].append(f"{type(cache).__name__}.{name}: {exc!r}")
                    continue
                if value is MISSING:
                    continue
                found["reads"] += 1
                key = (id(cache), name)
                if value is None:
                    if last.get(key) == "value":
                        last[key] = "none-after-value"
                else:
                    if last.get(key) == "none-after-value":
                        found["flickers"].append(f"{type(cache).__name__}.{name}")
                    last[key] = "value"
            try:
                cache.make_mask(1)
            except Exception as exc:
                found["errors"].append(f"{type(cache).__name__}.make_mask: {exc!r}")


def decode(model_dir, max_tokens, with_reader):
    model, _ = mlx_lm.load(model_dir)
    spy = Spy(model)
    gen = BatchGenerator(spy, max_tokens=max_tokens)
    uids = gen.insert(PROMPTS, max_tokens=[max_tokens] * len(PROMPTS))
    step = getattr(gen, "next_generated", None) or gen.next
    found = {"reads": 0, "errors": [], "flickers": []}
    stop = threading.Event()
    reader = threading.Thread(target=poll, args=(spy, stop, found), daemon=True)
    tokens = {uid: [] for uid in uids}
    try:
        while responses := step():
            for r in responses:
                tokens[r.uid].append(r.token)
            # polled from the first decoded token on: the prompts are in (upstream's own make_mask reads an
            # attribute twice, so a reader racing the prefill's finalize() can fail there with kvpatch off too)
            if with_reader and reader.ident is None:
                reader.start()
    finally:
        stop.set()
        if reader.ident is not None:
            reader.join()
        close = getattr(gen, "close", None)
        if close is not None:
            close()
    found["tokens"] = [tokens[uid] for uid in uids]
    found["errors"] = sorted(set(found["errors"]))
    found["flickers"] = sorted(set(found["flickers"]))
    return found
"""

#: Past the first growth of the attention layer's 256-token KV buffer (``step`` is read there by the owner).
TOKENS = 270


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    sys.path.insert(0, str(SERVING))
    try:
        from tinymodels import write_lm_model
    finally:
        sys.path.remove(str(SERVING))
    return str(write_lm_model(tmp_path_factory.mktemp("lfm2"), "lfm2"))


@pytest.mark.requires_patch("arrays-advance-detach")  # (its releases have the LFM2 this decodes)
def test_reader_thread_during_hybrid_batch_decode(model_dir, run_py):
    namespace: dict = {"__name__": "faults_threads_decode"}
    exec(compile(DECODE, "faults_threads_decode", "exec"), namespace)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        on = namespace["decode"](model_dir, TOKENS, True)
    finally:
        sys.setswitchinterval(interval)
    off = json.loads(
        run_py(
            DECODE + f"\nprint(json.dumps(decode({model_dir!r}, {TOKENS}, False)))",
            env={"KVPATCH": "off", "HF_HUB_OFFLINE": "1"},
        )
        .strip()
        .splitlines()[-1]
    )
    summary = f"kvpatch on: {on['reads']} reads, errors {on['errors']}, None between values {on['flickers']}"
    assert on["reads"] > 0, summary
    assert not on["errors"], summary
    assert not on["flickers"], summary
    assert all(len(t) == TOKENS for t in on["tokens"]), summary
    assert on["tokens"] == off["tokens"], summary


def _batch_kv_classes() -> list:
    """The batch KV cache classes whose ``step`` the growth tie serves in this process."""
    from _edges import growth_period

    found = []
    try:
        from mlx_lm.models.cache import BatchKVCache
    except ImportError:  # mlx-lm before its batch caches
        BatchKVCache = None
    if BatchKVCache is not None and growth_period(BatchKVCache):
        found.append(BatchKVCache)
    try:
        from mlx_vlm.models.cache import BatchKVCache as VlmBatchKVCache
    except ImportError:
        pass
    else:
        if VlmBatchKVCache is not BatchKVCache and growth_period(VlmBatchKVCache):
            found.append(VlmBatchKVCache)
    return found


def test_reading_step_from_another_thread_stores_nothing():
    import mlx.core as mx

    classes = _batch_kv_classes()
    if not classes:
        pytest.skip("no batch KV cache's step is served by the growth tie here")
    for cls in classes:
        cache = cls([1, 0])
        k = mx.random.normal((2, 2, 3, 8))
        for _ in range(3):
            out = cache.update_and_fetch(k, k)
            mx.eval(out)
            k = k[:, :, :1]
        before = dict(vars(cache))
        seen: list = []
        reader = threading.Thread(target=lambda c=cache, s=seen: s.extend((c.step, c.offset, c.keys) for _ in range(3)))
        reader.start()
        reader.join()
        errors = [] if len(seen) == 3 else ["the reader failed (see the thread's traceback above)"]
        assert not errors and seen[0][0] == cls.step, (cls, errors)
        after = dict(vars(cache))
        assert before.keys() == after.keys() and all(after[key] is value for key, value in before.items()), (
            cls,
            before,
            after,
        )
        assert cache.step == cls.step and dict(vars(cache)).keys() == before.keys()  # the owner's other reads too
        for _ in range(cls.step):  # the owner grows its buffer and evaluates: nothing of the reader's in the graph
            mx.eval(cache.update_and_fetch(k, k))
        assert cache.offset.tolist() == [5 - 1 + cls.step, 5 + cls.step]
