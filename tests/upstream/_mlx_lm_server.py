"""Drive mlx_lm.server.ResponseGenerator in-process (no HTTP, no model download) for prompt-cache tests.

A duck-typed ModelProvider holding tiny random-weight llamas (optionally a draft), a tokenizer that maps one
character to one id (so any token list can be sent back as text), and the server's request dataclasses
filled for whatever fields the running release gives them. Not a test module.
"""

from __future__ import annotations

import argparse
import dataclasses
import threading

from kvpatch.patches._prompt_cache import prompt_cache_class

VOCAB = 128


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


def tiny_llama(noise: float = 0.0):
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
    if noise:  # a draft: the main model with noise on every weight, agreeing on some tokens only
        mx.random.seed(1)
        model.update(tree_map(lambda p: p + noise * mx.abs(p).mean() * mx.random.normal(p.shape), model.parameters()))
    mx.eval(model.parameters())
    return model


class _Provider:
    """What ResponseGenerator reads from mlx_lm.server.ModelProvider, with the model already loaded."""

    def __init__(self, model, draft=None):
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        self.cli_args = argparse.Namespace(
            model=None, adapter_path=None, draft_model=None, allowed_origins=["*"], chat_template="",
            chat_template_args={}, decode_concurrency=8, prompt_concurrency=8, max_tokens=8, min_p=0.0,
            num_draft_tokens=3, pipeline=False, prefill_step_size=2048, prompt_cache_bytes=None,
            prompt_cache_size=10, temp=0.0, top_k=0, top_p=1.0, trust_remote_code=False,
            use_default_chat_template=False, kv_bits=None, kv_group_size=64, quantized_kv_start=0,
        )  # fmt: skip
        self.model, self.draft_model, self.processor = model, draft, None
        self.tokenizer = TokenizerWrapper(_Tokenizer())
        # (a draft model makes the server serve one request at a time, as ModelProvider decides)
        self.model_key, self.is_batchable = ("tiny", None, "draft" if draft else None), draft is None

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


class Server:
    def __init__(self, model, draft=None):
        from mlx_lm import server

        self.server = server
        self.generator = server.ResponseGenerator(_Provider(model, draft), prompt_cache_class()())

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
