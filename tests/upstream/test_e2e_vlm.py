"""End-to-end continuous batching with mlx-vlm's batch caches, one scenario per cache family.

Each scenario drives a tiny random-weight model from mlx-vlm's own classes (pixtral's language model:
hidden 64, 2 layers, grouped-query attention; float32, and bfloat16 as servers load weights) the way
mlx-vlm's server drives it (``BatchGenerator``: ``PromptProcessingBatch`` prefills, ``GenerationBatch``
decodes), with the caches built by the server's own ``_make_cache`` for each family:

* ``quantized``: ``--kv-bits 4`` (uniform scheme), ``BatchQuantizedKVCache``;
* ``turboquant``: ``--kv-bits 4 --kv-quant-scheme turboquant``, ``BatchTurboQuantKVCache``;
* ``plain``: no kv-bits, ``BatchKVCache`` (mlx-lm's class before mlx-vlm 0.6.4, mlx-vlm's own copy after).

The scenario: three prompts of different lengths are prefilled together, left-padded; greedy decode;
a second prompt batch (two rows, one longer than the running batch's context) is prefilled on its own
caches and merged in with ``extend``; decode; a row whose prompt is a single token joins with an empty
cache (``extend`` with a cache that has no keys yet, its token is fed by the next batched step); decode;
the longest row finishes and is filtered out (``filter``, which also drops the leading padding every
kept row shares); decode. Every row's greedy tokens must equal those the same prompt produces decoded
alone (one-row cache of the same family, from the same factory), and every step's logits must agree
(within the rounding of the model's dtype: ``kvpatch.testing.difference``). With bfloat16 the dense and
uniform quantized caches must also keep storing bfloat16 through every join (a float32 cache doubles
the memory and changes the numbers); TurboQuant's packed state records no dtype.

A second pair of scenarios drives the caches the way a server does around cancellations and prompt-cache
stores: a left-padded batch whose one unpadded request is cancelled (``filter``) before the first prefill chunk
(every family), and a right-padded batch (``prepare(right_padding, lengths)``) whose shortest row is extracted
after the last prefill chunk but before ``finalize`` and decoded alone, while the others go on batched (dense
and uniform quantized; TurboQuant has no ``prepare``/``extract``, nor has the quantized class before 0.6.5).
Measured without patches: on 0.5.0 the cancel raises ``[broadcast_shapes]`` at the first prefill chunk in every
family (``batch-filter-unprimed`` on mlx-lm 0.31.3's class, ``batch-filter-unprimed-vlm``, ``tq-filter-unprimed``)
and the extracted dense row's tokens differ from the second on (``batch-extract-right-padding``); on 0.7.10 the
cancel is fixed upstream and the extracted row differs in both families (``batch-extract-right-padding-vlm``).

Runs on mlx-vlm 0.5.0 and 0.7.10 (the two ends of the patched range) with the installed patches; it is
skipped on every other release. Measured without patches (``KVPATCH_DISABLE``): on 0.5.0 the uniform and
TurboQuant scenarios fail in both dtypes (``left-padding-mask``: first tokens wrong; ``batch-quantized-extend``
/ ``empty-tq-rows``: the decode after the empty-cache join raises; ``qsdpa-gqa-batch-mask``: the quantized
prefill raises) and the dense one in bfloat16 (``batch-extend-empty``: float32 cache after the empty join);
on 0.7.10 the TurboQuant scenario fails (``empty-tq-rows``) and the dense one in bfloat16
(``vlm-batch-extend-dtype``, mlx-vlm's own copy of ``extend``: float32 cache after the empty join).
"""

from __future__ import annotations

import pytest

import kvpatch
from kvpatch.testing import (
    agreeing_steps,
    difference,
    quantization_gap,
    same_greedy,
    tiny_pixtral_language_model,
    worst,
)

RELEASES = ("0.5.0", "0.7.10")
FAMILIES = ("quantized", "turboquant", "plain")
KV_BITS = 4
KV_GROUP_SIZE = 64  # the server's default --kv-group-size (head dim 64 below)
#: The model dtypes. Logits are compared within the dtype's rounding (``kvpatch.testing.difference``). bfloat16: from
#: mlx-vlm 0.7.0 a one-row unpadded TurboQuant cache attends through TurboQuant's own decode kernels
#: (``_turboquant_attention_applies``: float32 scores on the packed state) while a padded batch dequantizes and runs
#: SDPA in bfloat16, so the single-row reference and the batch round differently: measured up to 0.039 on logits of
#: magnitude < 2 (5 bf16 steps) on 0.7.10, with equal tokens.
DTYPES = ("float32", "bfloat16")


FIRST = {"a": [5, 9, 13, 2, 17], "b": [7, 3], "c": [22, 41, 8, 19, 30, 11, 6]}
SECOND = {"d": [14, 27, 33, 4, 9, 50, 21, 18, 44, 2, 36, 12], "e": [25, 31, 16]}
EMPTY_JOIN = ("f", [38])
FINISHES = "d"  # no left padding left after the joins: filtering it drops the padding the others share


@pytest.fixture(scope="module", autouse=True)
def _release():
    upstream = kvpatch.get_engine().upstream.get("mlx-vlm")
    version = upstream.version if upstream is not None else None
    if version is None:
        pytest.skip("mlx-vlm is not installed")
    if version not in RELEASES:
        pytest.skip(f"end-to-end scenarios run on mlx-vlm {' and '.join(RELEASES)} only (installed: {version})")


@pytest.fixture(scope="module", params=DTYPES)
def dtype(request):
    return request.param


@pytest.fixture(scope="module")
def model(dtype):
    import mlx.core as mx

    return tiny_pixtral_language_model(head_dim=64, heads=4, kv_heads=2, dtype=getattr(mx, dtype))


def _server_make_cache():
    try:
        from mlx_vlm.generate.ar import _make_cache  # 0.6.x+: generate is a package
    except ImportError:
        from mlx_vlm.generate import _make_cache  # 0.5.0
    return _make_cache


def _factory(model, family):
    """The server's cache factory for this family: ``left_padding -> one cache per layer``."""
    from mlx_vlm.models import cache as vlm_cache
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    make_cache = _server_make_cache()
    options = {
        "quantized": {"kv_bits": KV_BITS, "kv_group_size": KV_GROUP_SIZE, "kv_quant_scheme": "uniform"},
        "turboquant": {"kv_bits": KV_BITS, "kv_quant_scheme": "turboquant"},
        "plain": {},
    }[family]
    expected = {
        "quantized": vlm_cache.BatchQuantizedKVCache,
        "turboquant": BatchTurboQuantKVCache,
        "plain": vlm_cache.BatchKVCache,
    }[family]

    def make(left_padding):
        caches = make_cache(model, list(left_padding), **options)
        kinds = {type(c) for c in caches}
        assert kinds == {expected}, f"{family}: the server built {kinds}, not {expected.__name__}"
        return caches

    return make


def _logits(model, tokens, caches):
    import mlx.core as mx

    out = model(mx.array(tokens), cache=caches)
    logits = out.logits if hasattr(out, "logits") else out
    logits = logits[:, -1, :].astype(mx.float32)
    mx.eval(logits)
    return logits


def _left_pad(prompts):
    width = max(map(len, prompts))
    padding = [width - len(p) for p in prompts]
    return padding, [[0] * pad + p for pad, p in zip(padding, prompts, strict=True)]


class _Server:
    """The running batch: one cache list, the rows in batch order, each row's next input token."""

    def __init__(self, model, make):
        self.model, self.make = model, make
        self.rows, self.next, self.caches = [], [], None
        self.tokens, self.logits = {}, {}
        self.stored = []  # (when, float dtypes the dense / uniform quantized caches store)

    def _emit(self, names, logits):
        import mlx.core as mx

        chosen = mx.argmax(logits, axis=-1).tolist()
        for i, name in enumerate(names):
            self.tokens.setdefault(name, []).append(chosen[i])
            self.logits.setdefault(name, []).append(logits[i])
        return chosen

    def _prefill(self, prompts):
        """A prompt batch (PromptProcessingBatch): left-padded prefill on its own caches, first tokens."""
        padding, tokens = _left_pad(list(prompts.values()))
        caches = self.make(padding)
        first = self._emit(list(prompts), _logits(self.model, tokens, caches))
        return caches, first

    def _join(self, names, caches, next_tokens, how):
        """GenerationBatch.extend: the running caches take the new rows (``ca.extend(cb)`` per layer)."""
        if self.caches is None:
            self.caches = caches
        else:
            for running, new in zip(self.caches, caches, strict=True):
                running.extend(new)
        self.rows += names
        self.next += next_tokens
        self.stored.append((how, _stored_float_dtypes(self.caches)))

    def admit(self, prompts):
        caches, first = self._prefill(prompts)
        self._join(list(prompts), caches, first, f"after joining {list(prompts)}")

    def admit_with_empty_cache(self, name, prompt):
        """A row whose cache has nothing yet (one-token prompt): its token goes into the next step."""
        assert len(prompt) == 1
        caches = self.make([0])
        assert all(c.keys is None for c in caches)
        self._join([name], caches, prompt, f"after {name!r} joined with an empty cache")

    def decode(self, steps):
        for _ in range(steps):
            logits = _logits(self.model, [[t] for t in self.next], self.caches)
            self.next = self._emit(self.rows, logits)

    def finish(self, name):
        """GenerationBatch.filter: drop a finished row from every cache."""
        import mlx.core as mx

        keep = [i for i, row in enumerate(self.rows) if row != name]
        for c in self.caches:
            c.filter(mx.array(keep, mx.int32))
        self.rows = [self.rows[i] for i in keep]
        self.next = [self.next[i] for i in keep]


def _stored_float_dtypes(caches):
    """The floating dtypes a dense (keys) or uniform quantized (scales, biases) cache stores; TurboQuant's
    packed state (NamedTuples of codes and float16 norms) records no input dtype and is left out."""
    import mlx.core as mx

    found = set()
    for c in caches:
        for part in (c.keys, c.values):
            if isinstance(part, mx.array):
                found.add(part.dtype)
            elif type(part) is tuple:
                found.update(a.dtype for a in part if mx.issubdtype(a.dtype, mx.floating))
    return found


def _alone(model, make, prompt, n):
    """The same prompt decoded greedily alone, on a one-row cache of the same family."""
    import mlx.core as mx

    caches = make([0])
    logits = _logits(model, [prompt], caches)
    tokens, steps = [], []
    for _ in range(n):
        steps.append(logits[0])
        tokens.append(mx.argmax(logits[0]).item())
        if len(tokens) < n:
            logits = _logits(model, [[tokens[-1]]], caches)
    return tokens, steps


@pytest.mark.parametrize("family", FAMILIES)
def test_continuous_batching_rows_match_rows_alone(dtype, model, family):
    import mlx.core as mx

    make = _factory(model, family)
    server = _Server(model, make)
    server.admit(FIRST)
    server.decode(2)
    server.admit(SECOND)
    server.decode(2)
    server.admit_with_empty_cache(*EMPTY_JOIN)
    server.decode(2)
    server.finish(FINISHES)
    assert FINISHES not in server.rows and len(server.rows) == 5
    server.decode(3)

    prompts = {**FIRST, **SECOND, EMPTY_JOIN[0]: EMPTY_JOIN[1]}
    gap = _quantization_gap(family, dtype)
    for name, prompt in prompts.items():
        batched = server.tokens[name]
        tokens, steps = _alone(model, make, prompt, len(batched))
        # equal tokens, or a split at a near tie (scores within the rounding), after which the contexts differ
        split = same_greedy(batched, tokens, steps, getattr(mx, dtype))
        assert split is None, f"{family}: row {name!r} generated {batched} in the batch, {tokens} alone: {split}"
        if gap:
            continue
        shared = agreeing_steps(batched, tokens)
        found = worst(
            difference(b, s, getattr(mx, dtype), where=f"{family}, {dtype}: row {name!r} logits, from the row alone")
            for b, s in zip(server.logits[name][:shared], steps[:shared], strict=True)
        )
        assert found.within, found
    for when, stored in server.stored:
        assert stored <= {getattr(mx, dtype)}, f"{family}: {when} the caches store {stored} for a {dtype} model"
    if gap:
        pytest.skip(f"tokens and stored dtypes checked; logits not compared: {gap}")


def _quantization_gap(family: str, dtype: str) -> str | None:
    """Why this family's rows cannot be compared with the rows alone within the rounding here, or None."""
    import mlx.core as mx

    return quantization_gap(getattr(mx, dtype)) if family in ("turboquant", "quantized") else None


# --- a server driving the caches itself: a cancel before the first prefill, an extract mid-prefill ---------------

CHUNK = 4  # prefill step


def _decode_rows(model, caches, first, n):
    """Greedy decoding of every row of ``caches``; ``first`` (one token per row) goes in first. Returns the tokens
    (``first`` included, ``n`` per row) and each step's float32 logits per row."""
    import mlx.core as mx

    tokens = [[t] for t in first]
    steps = [[] for _ in first]
    for _ in range(n - 1):
        logits = _logits(model, [row[-1:] for row in tokens], caches)
        for i, token in enumerate(mx.argmax(logits, axis=-1).tolist()):
            tokens[i].append(token)
            steps[i].append(logits[i])
    return tokens, steps


def _assert_like_alone(model, make, dtype, family, name, prompt, tokens, first_logits, steps):
    import mlx.core as mx

    alone, alone_steps = _alone(model, make, prompt, len(tokens))
    assert tokens == alone, f"{family}: row {name!r} generated {tokens}, {alone} alone"
    if _quantization_gap(family, dtype):
        return  # (the caller skips once every row's tokens are checked)
    found = worst(
        difference(b, s, getattr(mx, dtype), where=f"{family}, {dtype}: row {name!r} logits, from the row alone")
        for b, s in zip([first_logits, *steps], alone_steps, strict=True)
    )
    assert found.within, found


@pytest.mark.parametrize("family", FAMILIES)
def test_server_cancels_a_request_before_its_first_prefill(dtype, model, family):
    """A left-padded prompt batch (the server's own caches for the family); the one request without padding is
    cancelled (``filter``) before the first prefill chunk; the others are prefilled in chunks and decoded: each
    equals its prompt decoded alone (batch-filter-unprimed, batch-filter-unprimed-vlm, tq-filter-unprimed)."""
    import mlx.core as mx

    make = _factory(model, family)
    names = list(FIRST)
    padding, padded = _left_pad(list(FIRST.values()))
    caches = make(padding)
    keep = [i for i, p in enumerate(padding) if p > 0]  # "c", the longest, is cancelled
    assert len(keep) == len(names) - 1
    for c in caches:
        c.filter(mx.array(keep, mx.int32))
    rows = [padded[i] for i in keep]
    for start in range(0, len(rows[0]), CHUNK):
        logits = _logits(model, [r[start : start + CHUNK] for r in rows], caches)
    first = mx.argmax(logits, axis=-1).tolist()
    tokens, steps = _decode_rows(model, caches, first, 6)
    for row, i in enumerate(keep):
        _assert_like_alone(model, make, dtype, family, names[i], FIRST[names[i]], tokens[row], logits[row], steps[row])
    gap = _quantization_gap(family, dtype)
    if gap:
        pytest.skip(f"tokens checked; logits not compared: {gap}")


@pytest.mark.parametrize("family", ["plain", "quantized"])
def test_server_extracts_a_row_mid_prefill_and_continues_it_alone(dtype, model, family):
    """A right-padded prompt batch (``prepare(right_padding, lengths)``, as mlx-vlm's mixed warm/cold prefill
    declares it) prefilled in chunks; after the last chunk, before ``finalize``, the shortest row's cache is
    extracted and decoded alone: it equals that prompt decoded alone (batch-extract-right-padding(-vlm)). The
    batch then finalizes, drops that row and decodes the others, which equal their prompts alone too."""
    import mlx.core as mx

    make = _factory(model, family)
    prompts = {**SECOND, "a": FIRST["a"]}  # 12, 3 and 5 tokens
    names, lengths = list(prompts), [len(p) for p in prompts.values()]
    caches = make([0] * len(names))
    if not all(hasattr(c, "prepare") and hasattr(c, "extract") for c in caches):
        pytest.skip(f"{family}: this release's batch cache has no prepare()/extract()")
    width = max(lengths)
    for c in caches:
        c.prepare(right_padding=[width - n for n in lengths], lengths=lengths)
    padded = [p + [0] * (width - len(p)) for p in prompts.values()]
    last = {}
    for start in range(0, width, CHUNK):
        out = model(mx.array([r[start : start + CHUNK] for r in padded]), cache=caches)
        logits = (out.logits if hasattr(out, "logits") else out).astype(mx.float32)
        for row, n in enumerate(lengths):
            if start <= n - 1 < start + CHUNK:
                last[row] = logits[row, n - 1 - start]
    mx.eval(list(last.values()))

    short = names.index("e")
    saved = [c.extract(short) for c in caches]  # its 9 pads are written and still pending
    (tokens,), (steps,) = _decode_rows(model, saved, [mx.argmax(last[short]).item()], 6)
    _assert_like_alone(model, make, dtype, family, "e", prompts["e"], tokens, last[short], steps)

    keep = [i for i in range(len(names)) if i != short]
    for c in caches:
        c.finalize()
        c.filter(mx.array(keep, mx.int32))
    tokens, steps = _decode_rows(model, caches, [mx.argmax(last[i]).item() for i in keep], 6)
    for row, i in enumerate(keep):
        _assert_like_alone(model, make, dtype, family, names[i], prompts[names[i]], tokens[row], last[i], steps[row])
