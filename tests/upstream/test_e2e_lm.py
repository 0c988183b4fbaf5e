"""End-to-end scenarios driven the way users drive mlx-lm, on the oldest and newest supported releases.

Each scenario runs mlx-lm's own entry points (``stream_generate``, ``BatchGenerator``, ``save_prompt_cache`` /
``load_prompt_cache``) on tiny random-weight llamas (hidden 64, 2 layers, greedy decoding, no download) with
every kvpatch patch that applies, and compares the tokens with references that avoid the code paths kvpatch
fixes: the same conversation generated in one go, the same row generated alone, and the model driven by hand one
token at a time after its first prefill chunk (so no attention mask ever meets a quantized cache).

1. ``stream_generate`` with ``kv_bits`` and a draft model, then the chat continued from the same prompt cache.
2. ``BatchGenerator`` with rows of different prompt lengths, rows inserted while others decode and a row that
   reaches ``max_tokens`` early and leaves: every row equals the same prompt run through ``generate_step``
   alone (also with a ``max_kv_size`` window).
3. A prompt cache saved with ``save_prompt_cache``, loaded with ``load_prompt_cache`` and continued (plain and
   ``kv_bits`` quantized caches).
4. A server driving ``BatchKVCache`` itself: a left-padded batch whose longest request is cancelled (``filter``)
   before its first prefill chunk, and a right-padded batch whose shortest row is extracted after the last
   prefill chunk but before ``finalize`` and continued alone (the others continue batched): every row equals
   its prompt generated alone (from 0.28.4, where ``prepare``/``extract`` exist; measured without patches on
   0.32.2: the cancel raises ``[broadcast_shapes]`` at the first prefill chunk (``batch-filter-unprimed``), the
   extracted row holds 10 positions for 5 tokens and its tokens differ from the second on
   (``batch-extract-right-padding``)).

They run only on mlx-lm 0.22.0 and 0.32.2 released code (CI time: this file runs in every bucket).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect

import pytest

from kvpatch import get_engine  # importing kvpatch installs the patches before mlx-lm is imported
from kvpatch.testing import same_greedy, tiny_llama

mx = pytest.importorskip("mlx.core")

RELEASES = ("0.22.0", "0.32.2")
_UPSTREAM = get_engine().upstream.get("mlx-lm")
_VERSION = _UPSTREAM.version if _UPSTREAM is not None else None
_RELEASED = _UPSTREAM is not None and _UPSTREAM.source.kind in ("index", "archive")

pytestmark = pytest.mark.skipif(
    _VERSION not in RELEASES or not _RELEASED,
    reason=(
        f"end-to-end scenarios run on mlx-lm {' and '.join(RELEASES)} released code only (oldest and newest "
        f"supported); installed: {_UPSTREAM or 'none'}"
    ),
)

VOCAB = 128
# kv-bits options as the CLI passes them (--kv-bits 8 --kv-group-size 32 --quantized-kv-start 0).
KV_BITS = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0)


class _Tokenizer:
    """The least a tokenizer needs for TokenizerWrapper and its naive detokenizer: ids <-> one letter each."""

    eos_token_id = None
    bos_token = None
    chat_template = None
    clean_up_tokenization_spaces = False
    vocab_size = VOCAB

    def get_vocab(self):
        return {f"<{i}>": i for i in range(self.vocab_size)}

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % self.vocab_size for c in text]

    def decode(self, ids, **kwargs):
        return "".join(chr(65 + i % 26) for i in ids)

    def apply_chat_template(self, messages, **kwargs):
        return []

    def convert_tokens_to_ids(self, token):
        return self.get_vocab().get(token)


def _tokens(seed: int, *lengths: int) -> list[list[int]]:
    mx.random.seed(seed)
    return [mx.random.randint(0, VOCAB, (n,)).tolist() for n in lengths]


def _generation_module():
    """Where stream_generate / generate_step live: mlx_lm.utils up to 0.22.x, mlx_lm.generate from 0.23."""
    for name in ("mlx_lm.generate", "mlx_lm.utils"):
        module = importlib.import_module(name)
        if "speculative_generate_step" in vars(module):
            return module
    raise LookupError("no mlx-lm module defines speculative_generate_step")


class _Lm:
    def __init__(self, module):
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        self.module = module
        self.main = tiny_llama(heads=2, kv_heads=1, vocab=VOCAB, doubled=True)
        self.draft = tiny_llama(heads=2, kv_heads=1, vocab=VOCAB, doubled=True, noise=0.05)
        self.tokenizer = TokenizerWrapper(_Tokenizer())

    def stream(self, prompt, n, cache=None, draft=False, **options):
        """stream_generate as a user calls it; returns the tokens and, per token, whether the draft produced it."""
        got = {}
        for response in self.module.stream_generate(
            self.main,
            self.tokenizer,
            mx.array(prompt),
            max_tokens=n,
            draft_model=self.draft if draft else None,
            prompt_cache=cache,
            **options,
        ):
            # 0.22.0 yields the last token twice (once more with its finish_reason): key by position.
            got[response.generation_tokens] = (response.token, response.from_draft, response.logprobs)
        steps = [got[k] for k in sorted(got)]
        self.scores = [s for _, _, s in steps]
        return [t for t, _, _ in steps], [d for _, d, _ in steps]

    def alone(self, prompt, n, cache=None, **options):
        """The reference: generate_step on one row, greedy."""
        generator = self.module.generate_step(mx.array(prompt), self.main, max_tokens=n, prompt_cache=cache, **options)
        steps = list(generator)
        self.scores = [logprobs for _, logprobs in steps]
        return [int(token) for token, _ in steps]

    def stepwise(self, prompt, n, kv_bits=None, kv_group_size=64, quantized_kv_start=0, first_call=4):
        """The reference with no multi-token attention over a quantized cache: the model driven by hand.

        The first ``first_call`` tokens go in one call on plain KVCaches, exactly as generate_step's first prefill
        chunk does (it quantizes the cache only after that call); every later token, prompt or generated, goes in
        alone, so no attention mask is ever applied to a quantized cache.
        """
        from mlx_lm.models.cache import make_prompt_cache

        assert quantized_kv_start == 0 and len(prompt) > first_call
        cache = make_prompt_cache(self.main)
        logits = self.main(mx.array(prompt[:first_call])[None], cache=cache)
        if kv_bits is not None:
            cache = [c.to_quantized(group_size=kv_group_size, bits=kv_bits) for c in cache]
        for token in prompt[first_call:]:
            logits = self.main(mx.array([[token]]), cache=cache)
        out, self.scores = [], []
        for _ in range(n):
            self.scores.append(logits[0, -1])
            out.append(int(mx.argmax(logits[0, -1])))
            logits = self.main(mx.array([out[-1:]]), cache=cache)
        return out

    def fresh(self, draft=False):
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.main) + (make_prompt_cache(self.draft) if draft else [])


@pytest.fixture(scope="module")
def lm():
    module = _generation_module()
    helper = _Lm(module)
    with pytest.MonkeyPatch.context() as patch:
        if not mx.metal.is_available():
            try:
                with module.wired_limit(helper.main):
                    pass
            except RuntimeError:
                # 0.22-0.24's wired_limit queries Metal unconditionally (RuntimeError on CPU) although it only
                # tunes Metal's wired memory; stream_generate enters it around every generation.
                patch.setattr(module, "wired_limit", lambda *a, **k: contextlib.nullcontext())
        yield helper


def _describe(cache):
    return [(type(c).__name__, c.offset) for c in cache]


def _agree(got, reference, scores, what):
    """Greedy tokens equal the reference's, or part from it at a near tie (see ``kvpatch.testing.same_greedy``);
    ``scores`` are the reference's per-step scores."""
    why = same_greedy(got, reference, scores)
    assert why is None, f"{what}: {got} != {reference}: {why}"


# --- 1. stream_generate with kv-bits and a draft model, chat continued from the same prompt cache ---------------


def _speculative_state(tokens, from_draft):
    """What speculative stream_generate leaves in the caller's (main + draft) cache, as upstream does it: it
    rewinds both caches to the accepted tokens, so the last token is in the main cache only when the draft
    proposed it (the main model then ran it as a verification input); the draft cache never holds it."""
    main = len(tokens) - (0 if from_draft[-1] else 1)
    return [("QuantizedKVCache", main)] * 2 + [("QuantizedKVCache", len(tokens) - 1)] * 2  # 2 layers per model


def test_speculative_kv_bits_chat_continues_like_uninterrupted(lm):
    first, second = _tokens(3, 9, 5)
    options = dict(KV_BITS, prefill_step_size=4, num_draft_tokens=2)
    cache = lm.fresh(draft=True)  # main and draft caches in one list, as stream_generate expects
    answer, from_draft = lm.stream(first, 12, cache, draft=True, **options)
    state = _describe(cache)
    # The next turn starts with the turn's tokens the main cache does not hold yet.
    held = _speculative_state(first + answer, from_draft)[0][1]
    follow, follow_from_draft = lm.stream((first + answer)[held:] + second, 8, cache, draft=True, **options)

    history = first + answer + second
    plain, _ = lm.stream(first, 12, lm.fresh(), **KV_BITS, prefill_step_size=4)
    plain_scores = lm.scores
    uninterrupted, _ = lm.stream(history, 8, lm.fresh(draft=True), draft=True, **options)
    uninterrupted_scores = lm.scores
    stepwise = lm.stepwise(history, 8, **KV_BITS)
    # Greedy speculative decoding gives the main model's own greedy tokens, with some drafts accepted.
    _agree(answer, plain, plain_scores, "speculative vs plain greedy")
    assert True in from_draft and False in from_draft, from_draft
    _agree(follow, uninterrupted, uninterrupted_scores, "continued chat vs uninterrupted")
    _agree(follow, stepwise, lm.scores, "continued chat vs stepwise")
    # The caller's list holds the live (quantized) caches after each turn.
    assert state == _speculative_state(first + answer, from_draft)
    assert _describe(cache) == _speculative_state(history + follow, follow_from_draft)


# --- 2. BatchGenerator: rows of different lengths joining and leaving -------------------------------------------


def _batch_module():
    module = importlib.import_module("mlx_lm.generate")
    if not hasattr(module, "BatchGenerator"):
        pytest.skip(f"mlx-lm {_VERSION} has no BatchGenerator (mlx_lm.generate has it from 0.28.0)")
    return module


# name: (prompt length, max_tokens). B reaches max_tokens first and leaves; C and D (a one-token prompt, which
# needs no prefill) are inserted while A and B decode; E is inserted once B has left.
ROWS = {"A": (11, 12), "B": (6, 3), "C": (8, 7), "D": (1, 5), "E": (5, 4)}


def _batch_prompts():
    return dict(zip(ROWS, _tokens(5, *(length for length, _ in ROWS.values())), strict=True))


def _drive_batch(generator, prompts):
    """Continuous batching as a server drives it; returns each row's tokens and the event log."""
    names, got, events = {}, {name: [] for name in prompts}, []
    step = getattr(generator, "next_generated", None) or generator.next

    def insert(*rows):
        uids = generator.insert([prompts[r] for r in rows], [ROWS[r][1] for r in rows])
        names.update(zip(uids, rows, strict=True))
        decoding = {r: len(got[r]) for r in names.values() if got[r] and ("done", r) not in events}
        events.append(("insert", rows, decoding))

    insert("A", "B")
    while responses := step():
        for response in responses:
            row = names[response.uid]
            got[row].append(response.token)
            if response.finish_reason is not None:
                events.append(("done", row))
        if "C" not in names.values() and got["A"] and got["B"]:
            insert("C", "D")
        if "E" not in names.values() and ("done", "B") in events:
            insert("E")
    return got, events


@pytest.mark.parametrize("window", [None, 8], ids=["unbounded", "max_kv_size=8"])
def test_batch_generator_rows_match_rows_alone(lm, window):
    from mlx_lm.models.cache import RotatingKVCache

    module = _batch_module()
    prompts = _batch_prompts()
    generator = module.BatchGenerator(
        lm.main, max_kv_size=window, prefill_step_size=4, prefill_batch_size=4, completion_batch_size=8
    )
    got, events = _drive_batch(generator, prompts)
    generator.close()

    # The scenario happened: C and D joined while A and B were decoding, B left before the others finished,
    # E joined after B had left and while A was still decoding.
    assert events[1][:2] == ("insert", ("C", "D")) and set(events[1][2]) == {"A", "B"}, events
    done = [e[1] for e in events if e[0] == "done"]
    assert done[0] == "B" and done[-1] == "A", events
    assert events.index(("done", "B")) < events.index(next(e for e in events if e[:2] == ("insert", ("E",)))), events

    for row, prompt in prompts.items():
        # BatchRotatingKVCache keeps no attention-sink tokens (see the next test): its alone reference is a
        # RotatingKVCache with the same window and keep=0.
        cache = None if window is None else [RotatingKVCache(max_size=window, keep=0) for _ in lm.main.layers]
        alone = lm.alone(prompt, ROWS[row][1], cache)
        _agree(got[row], alone, lm.scores, f"row {row}: batched vs alone")


def test_batch_generator_window_equals_generate_step_max_kv_size(lm):
    module = _batch_module()
    from mlx_lm.models.cache import BatchRotatingKVCache

    if "keep" not in inspect.signature(BatchRotatingKVCache.__init__).parameters:
        pytest.skip(
            f"upstream limitation, not patched by kvpatch: mlx-lm {_VERSION}'s BatchRotatingKVCache has no `keep`: "
            "BatchGenerator(max_kv_size=N) evicts a row's oldest tokens once its context exceeds N, while "
            "generate_step(max_kv_size=N) builds RotatingKVCache(max_size=N, keep=4), which never evicts the first 4 "
            "(attention sink), so a row whose context exceeds the window differs from the same row generated alone "
            "(measured, window 8: the 11-token row from its first generated token, the 8-token row from its third; "
            "rows that stay within the window are equal). test_batch_generator_rows_match_rows_alone checks the "
            "windowed batch against rows generated alone with RotatingKVCache(max_size=8, keep=0)."
        )
    prompts = _batch_prompts()
    generator = module.BatchGenerator(lm.main, max_kv_size=8, prefill_step_size=4)
    got, _ = _drive_batch(generator, prompts)
    generator.close()
    for row, prompt in prompts.items():
        alone = lm.alone(prompt, ROWS[row][1], max_kv_size=8)
        _agree(got[row], alone, lm.scores, f"row {row}: batched vs alone")


# --- 3. a prompt cache saved, loaded and continued -------------------------------------------------------------


@pytest.mark.parametrize("kv", [{}, KV_BITS], ids=["fp", "kv_bits=8"])
def test_saved_prompt_cache_continues_like_uninterrupted(lm, kv, tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    first, second = _tokens(3, 9, 5)
    cache = lm.fresh()
    answer, _ = lm.stream(first, 12, cache, prefill_step_size=4, **kv)
    before = _describe(cache)
    # generate_step has already run the last answer token through the model: the cache holds the whole turn.
    assert before == [("QuantizedKVCache" if kv else "KVCache", len(first) + len(answer))] * len(cache)

    path = str(tmp_path / "chat.safetensors")
    save_prompt_cache(path, cache, {"turns": "1"})
    loaded, metadata = load_prompt_cache(path, return_metadata=True)
    assert metadata == {"turns": "1"} and _describe(loaded) == before

    follow, _ = lm.stream(second, 8, loaded, prefill_step_size=4, **kv)
    history = first + answer + second
    uninterrupted, _ = lm.stream(history, 8, lm.fresh(), prefill_step_size=4, **kv)
    uninterrupted_scores = lm.scores
    stepwise = lm.stepwise(history, 8, **kv)
    _agree(follow, uninterrupted, uninterrupted_scores, "continued from the file vs uninterrupted")
    _agree(follow, stepwise, lm.scores, "continued from the file vs stepwise")


# --- 4. a server driving the batch cache API: a cancel before the first prefill, an extract mid-prefill ---------


def _batch_cache_api():
    from mlx_lm.models import cache as cache_module

    cls = getattr(cache_module, "BatchKVCache", None)
    if cls is None or not hasattr(cls, "extract"):
        pytest.skip(f"mlx-lm {_VERSION} has no BatchKVCache with prepare()/extract() (from 0.28.4)")
    return cls


def _decode(model, caches, first, n):
    """Greedy decoding of every row of ``caches``: ``first`` (one token per row) goes in first; ``n`` tokens per
    row, ``first`` included."""
    out = [[t] for t in first]
    for _ in range(n - 1):
        logits = model(mx.array([row[-1:] for row in out]), cache=caches)
        for row, token in zip(out, mx.argmax(logits[:, -1, :], axis=-1).tolist(), strict=True):
            row.append(token)
    return out


def test_server_cancels_a_request_before_its_first_prefill(lm):
    """Left-padded prompt batch (one BatchKVCache per layer, padding from construction, as mlx-vlm's server builds
    them); the longest request is cancelled (``filter``) before the first prefill chunk; the other rows are
    prefilled in chunks of 4 and decoded: each equals its prompt generated alone (batch-filter-unprimed)."""
    batch_kv_cache = _batch_cache_api()
    prompts = _tokens(11, 9, 4, 6)
    width = max(map(len, prompts))
    padding = [width - len(p) for p in prompts]
    caches = [batch_kv_cache(padding) for _ in lm.main.layers]
    keep = [1, 2]  # request 0, the only row without padding, is cancelled
    for c in caches:
        c.filter(mx.array(keep))
    tokens = mx.array([[0] * padding[i] + prompts[i] for i in keep])
    for start in range(0, width, 4):
        logits = lm.main(tokens[:, start : start + 4], cache=caches)
    got = _decode(lm.main, caches, mx.argmax(logits[:, -1, :], axis=-1).tolist(), 8)
    for row, i in enumerate(keep):
        alone = lm.alone(prompts[i], 8)
        assert got[row] == alone, f"request {i}: batched {got[row]} != alone {alone}"


def test_server_extracts_a_row_mid_prefill_and_continues_it_alone(lm):
    """Right-padded prompt batch prefilled in chunks of 4 (``prepare(lengths, right_padding)`` as
    ``PromptProcessingBatch`` declares it); after the last chunk, before ``finalize``, the shortest row's cache is
    extracted and continued alone, one token at a time: its tokens equal the prompt generated alone
    (batch-extract-right-padding). The batch then finalizes, drops that row and decodes the others, which also
    equal their prompts alone (the extract left the live cache as it was)."""
    batch_kv_cache = _batch_cache_api()
    prompts = _tokens(13, 5, 10, 8)
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    caches = [batch_kv_cache([0] * len(prompts)) for _ in lm.main.layers]
    for c in caches:
        c.prepare(lengths=lengths, right_padding=[width - n for n in lengths])
    tokens = mx.array([p + [0] * (width - len(p)) for p in prompts])
    last = {}
    for start in range(0, width, 4):
        logits = lm.main(tokens[:, start : start + 4], cache=caches)
        for row, n in enumerate(lengths):
            if start <= n - 1 < start + 4:
                last[row] = mx.argmax(logits[row, n - 1 - start]).item()

    saved = [c.extract(0) for c in caches]  # padding still pending: row 0 holds 5 tokens and 5 pads
    (alone_row,) = _decode(lm.main, saved, [last[0]], 8)
    assert alone_row == lm.alone(prompts[0], 8), f"extracted row {alone_row} != alone {lm.alone(prompts[0], 8)}"
    assert [c.offset for c in saved] == [lengths[0] + 7] * len(saved)

    for c in caches:
        c.finalize()
        c.filter(mx.array([1, 2]))
    got = _decode(lm.main, caches, [last[1], last[2]], 8)
    for row, i in enumerate([1, 2]):
        alone = lm.alone(prompts[i], 8)
        assert got[row] == alone, f"request {i}: batched {got[row]} != alone {alone}"
