"""speculative-stale-cache end to end: ``stream_generate`` with a draft model, as users call it.

A chat is continued from the caller's prompt cache (main + draft caches in one list, kv-bits on); the
continuation must equal one uninterrupted generation, and the caller's list must hold the live quantized
caches. The tokenizer is a trivial in-process one wrapped in mlx-lm's own ``TokenizerWrapper`` (no download).
"""

from __future__ import annotations

import contextlib
import importlib

import pytest

from kvpatch.patches.mlx_lm.speculative_stale_cache import PATCH, _LinkedCacheList
from kvpatch.testing import require_applies, tiny_llama, without

mx = pytest.importorskip("mlx.core")


@pytest.fixture(scope="module")
def applied():
    require_applies(PATCH)


class _Tokenizer:
    """The least a tokenizer needs for TokenizerWrapper and its naive detokenizer: ids <-> one letter each."""

    eos_token_id = None
    bos_token = None
    chat_template = None
    clean_up_tokenization_spaces = False
    vocab_size = 128

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


def _generate_module():
    for name in ("mlx_lm.generate", "mlx_lm.utils"):
        module = importlib.import_module(name)
        if "speculative_generate_step" in vars(module):
            return module
    raise LookupError("no module defines speculative_generate_step")


@pytest.fixture
def chat(applied, monkeypatch):
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    module = _generate_module()
    if not mx.metal.is_available():
        # Before 0.28 wired_limit queries Metal unconditionally (RuntimeError on CPU). It only tunes wired memory.
        monkeypatch.setattr(module, "wired_limit", lambda *a, **k: contextlib.nullcontext())
    main, draft = (tiny_llama(seed=s, heads=2, kv_heads=1, vocab=128, doubled=True) for s in (0, 1))
    tokenizer = TokenizerWrapper(_Tokenizer())
    options = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0, prefill_step_size=4, num_draft_tokens=2)

    def run(prompt, cache, n):
        got = {}
        for response in module.stream_generate(
            main, tokenizer, mx.array(prompt), max_tokens=n, draft_model=draft, prompt_cache=cache, **options
        ):
            got[response.generation_tokens] = response.token
        return [got[k] for k in sorted(got)]

    def fresh():
        return make_prompt_cache(main) + make_prompt_cache(draft)

    mx.random.seed(3)
    first = mx.random.randint(0, 128, (9,)).tolist()
    second = mx.random.randint(0, 128, (5,)).tolist()
    return run, fresh, first, second


def _conversation(run, fresh, first, second):
    cache = fresh()
    answer = run(first, cache, 12)
    state = [(type(c).__name__, c.offset) for c in cache]
    follow = run(answer[-1:] + second, cache, 8)
    reference = run(first + answer + second, fresh(), 8)
    return answer, state, follow, reference


def test_stream_generate_chat_continues_from_live_cache(chat):
    run, fresh, first, second = chat
    answer, state, follow, reference = _conversation(run, fresh, first, second)
    assert len(answer) == 12
    expected = len(first) + len(answer) - 1
    assert state == [("QuantizedKVCache", expected)] * 4
    assert follow == reference


def test_stream_generate_shows_the_bug_without_the_patch(chat):
    run, fresh, first, second = chat
    with without(PATCH.id):
        _, state, follow, reference = _conversation(run, fresh, first, second)
    assert all(kind == "KVCache" and offset < len(first) for kind, offset in state), state
    assert follow != reference


def test_without_kv_bits_tokens_are_unchanged(applied):
    from mlx_lm.models.cache import make_prompt_cache

    step = _generate_module().speculative_generate_step
    main, draft = (tiny_llama(seed=s, heads=2, kv_heads=1, vocab=128, doubled=True) for s in (0, 1))
    prompt = mx.array(list(range(3, 12)))

    def tokens():
        cache = make_prompt_cache(main) + make_prompt_cache(draft)
        out = [int(t) for t, _, _ in step(prompt, main, draft, prompt_cache=cache, max_tokens=10, prefill_step_size=4)]
        return out, [c.offset for c in cache]

    patched = tokens()
    with without(PATCH.id):
        unpatched = tokens()
    assert patched == unpatched
    no_cache = [int(t) for t, _, _ in step(prompt, main, draft, max_tokens=10, prefill_step_size=4)]
    assert no_cache == patched[0]


def test_linked_list_writes_through_slices():
    owner = list("abcdef")
    linked = _LinkedCacheList(owner, owner, 0)
    head, tail = linked[:2], linked[2:]
    tail[0] = "C"
    tail[-1] = "F"
    head[1] = "B"
    tail[1:][0] = "D"
    assert owner == list("aBCDeF")
    # Each slice is a copy that writes through to the caller's list, not to the list it was cut from.
    assert head == ["a", "B"] and tail == list("CdeF") and linked[1] == "b"
    assert isinstance(linked[::2], list) and not isinstance(linked[::2], _LinkedCacheList)
    assert type(linked)(x for x in "xy") == ["x", "y"]  # tree_map style rebuild: a plain, unlinked list
