"""prompt-cache-exact-hit beyond the reproduction: ``mlx_lm.server.ResponseGenerator`` driven in-process (no
HTTP) with a tiny random-weight llama. Request 2 is request 1's prompt plus its completion, an exact hit on
the entry request 1 left; with the patch it must be answered exactly as a server with an empty prompt cache
answers it, and the generation thread must still serve a third request. Also the non-trimmable case (a
recurrent-layer entry) at the prompt-cache level.
"""

from __future__ import annotations

import argparse
import dataclasses
import threading

import pytest
from kvpatch.patches.prompt_cache_exact_hit import PATCH, prompt_cache_class

from kvpatch.testing import require_affected

VOCAB = 128


@pytest.fixture(scope="module", autouse=True)
def _in_range():
    require_affected(PATCH)


class _Tokenizer:
    """ids <-> one character each (``ord(c) % 128``), so any token list can be sent back as text."""

    eos_token_id = None
    bos_token = None
    chat_template = None
    clean_up_tokenization_spaces = False
    vocab_size = VOCAB

    def get_vocab(self):
        return {f"<{i}>": i for i in range(VOCAB)}

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids, **kwargs):
        return "".join(chr(65 + i % 26) for i in ids)

    def apply_chat_template(self, messages, **kwargs):
        return []

    def convert_tokens_to_ids(self, token):
        return self.get_vocab().get(token)

    def convert_ids_to_tokens(self, ids):
        return [f"<{i}>" for i in ids] if isinstance(ids, list) else f"<{ids}>"


def _tiny_llama():
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models import llama

    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=VOCAB,
    )  # fmt: skip
    model = llama.Model(args)
    model.update(tree_map(lambda p: p * 2, model.parameters()))  # so greedy decoding does not repeat one token
    mx.eval(model.parameters())
    return model


class _Provider:
    """What ResponseGenerator reads from mlx_lm.server.ModelProvider, with the model already loaded."""

    def __init__(self, model):
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        self.cli_args = argparse.Namespace(
            model=None, adapter_path=None, draft_model=None, allowed_origins=["*"], chat_template="",
            chat_template_args={}, decode_concurrency=8, prompt_concurrency=8, max_tokens=8, min_p=0.0,
            num_draft_tokens=3, pipeline=False, prefill_step_size=2048, prompt_cache_bytes=None,
            prompt_cache_size=10, temp=0.0, top_k=0, top_p=1.0, trust_remote_code=False,
            use_default_chat_template=False, kv_bits=None, kv_group_size=64, quantized_kv_start=0,
        )  # fmt: skip
        self.model, self.draft_model, self.processor = model, None, None
        self.tokenizer = TokenizerWrapper(_Tokenizer())
        self.model_key, self.is_batchable = ("tiny", None, None), True

    def load(self, model_path=None, adapter_path=None, draft_model_path=None):
        return self.model, self.tokenizer

    def load_default(self):
        pass

    def reset(self):
        pass


_DEFAULTS = dict(
    model="default_model", draft=None, adapter=None, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
    xtc_probability=0.0, xtc_threshold=0.0, logit_bias=None, repetition_penalty=1.0, repetition_context_size=20,
    presence_penalty=0.0, presence_context_size=20, frequency_penalty=0.0, frequency_context_size=20,
    stop_words=[], num_draft_tokens=3, logprobs=False, top_logprobs=0, seed=None, chat_template_kwargs=None,
    request_type="text", messages=[], tools=None, role_mapping=None, max_tokens=8,
)  # fmt: skip


def _make(cls, **known):
    """One of the server's request dataclasses, whatever fields this release gives it."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in known or f.name in _DEFAULTS:
            kwargs[f.name] = known.get(f.name, _DEFAULTS.get(f.name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise TypeError(f"no value for {cls.__name__}.{f.name} on this release")
    return cls(**kwargs)


class _Server:
    def __init__(self, model):
        from mlx_lm import server

        self.server = server
        self.generator = server.ResponseGenerator(_Provider(model), prompt_cache_class()())

    def ask(self, text, timeout=30.0):
        s = self.server
        args = _make(
            s.GenerationArguments,
            model=_make(s.ModelDescription),
            sampling=_make(s.SamplingArguments),
            logits=_make(s.LogitsProcessorArguments),
        )
        request = _make(s.CompletionRequest, prompt=text)
        out = {}

        def run():
            try:
                _, responses = self.generator.generate(request, args)
                out["tokens"] = [r.token for r in responses]
            except Exception as exc:  # whatever the server hands back: recorded, the test asserts on it
                out["error"] = f"{type(exc).__name__}: {exc}"

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            out["error"] = f"no answer in {timeout:.0f} s"
        return out

    def close(self):
        self.generator._stop = True
        self.generator._generation_thread.join(10)


@pytest.fixture(scope="module")
def model():
    return _tiny_llama()


def test_server_answers_an_exact_hit_like_an_empty_cache(model):
    served = _Server(model)
    try:
        first = served.ask("hello world")
        assert "tokens" in first, first
        again = "hello world" + "".join(chr(t) for t in first["tokens"])  # prompt + completion, sent back
        second = served.ask(again, timeout=15)
        third = served.ask("another prompt", timeout=15)
        alive = served.generator._generation_thread.is_alive()
    finally:
        served.close()
    fresh = _Server(model)
    try:
        want = fresh.ask(again)
    finally:
        fresh.close()
    assert "tokens" in want, want
    assert second == want, f"exact hit answered {second}, an empty prompt cache answers {want}"
    assert "tokens" in third and alive, f"after the exact hit: {third}, generation thread alive: {alive}"


def test_untrimmable_entry_falls_back_to_a_shorter_one():
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache

    tokens = [5, 9, 2, 33, 17, 21]

    def entry(n):
        c = ArraysCache(size=1)
        c[0] = mx.full((1, 4), float(n))
        return [c]

    lru = prompt_cache_class()()
    lru.insert_cache("m", tokens[:4], entry(4))
    lru.insert_cache("m", tokens[:], entry(6))
    cache, rest = lru.fetch_nearest_cache("m", tokens[:])
    assert list(rest) == tokens[4:] and cache is not None and cache[0][0][0, 0].item() == 4.0
