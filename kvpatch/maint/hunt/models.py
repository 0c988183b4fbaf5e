"""Model level: for every architecture of the installed mlx-lm (``mlx_lm.models.<arch>``: ``ModelArgs``, ``Model``)
and mlx-vlm (``mlx_vlm.models.<arch>``: ``TextConfig``, ``LanguageModel``) for which a tiny random-weight config can
be built from its config class, a batch of left-padded prompts against each prompt alone (``logits-agree``), and
batched generation running where generation alone runs (``model-runs``).

mlx-lm's batch path is its ``BatchGenerator`` (log-probabilities of the first generated tokens, against
``generate_step`` on each prompt alone). mlx-vlm's is its ``BatchGenerator`` on the language model where the language
model takes the model's config (the mRoPE families: their positions come from the prompt's inputs) and the release's
generator takes prompt kwargs: each prompt's kwargs are what the package's ``Model.get_input_embeddings`` gives that
prompt alone, as mlx-vlm's server and ``batch_generate`` hand them over (``position_ids``, ``rope_deltas``; text
prompts never reach the vision tower). Elsewhere it is ``_make_cache`` (the batch caches its generator builds), driven
with the language model's own forward pass. Either is compared against the language model on each prompt alone
(``make_prompt_cache``). A config is tiny by the names of its fields (hidden size 64, three layers, four heads over
two KV heads, small vocabulary and experts); an architecture whose config or first forward pass fails that way is
listed as not covered, with the error. Runs inside a bucket.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import pkgutil
import random
import re
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from kvpatch.patches import _numbers

from .machine import Caught, Violation

# fmt: off
#: Field names the tiny configs set, and their values (what a field of that name means is the same across the
#: architectures: sizes, counts, ratios).
TINY: dict[str, Any] = {
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "dim": 64, "model_dim": 64, "hidden_dim": 64,
    "num_hidden_layers": 3, "n_layer": 3, "n_layers": 3, "num_layers": 3,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "ffn_hidden_size": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2, "multi_query_group_num": 2,
    "head_dim": 32, "kv_channels": 32,
    "vocab_size": 128, "n_vocab": 128, "padded_vocab_size": 128, "embedding_size": 128,  # olmo, molmo: the vocabulary
    "max_position_embeddings": 256, "n_positions": 256, "max_seq_len": 256,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4, "n_experts": 4,
    "num_experts_per_tok": 2, "n_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "top_k": 2,
    "n_shared_experts": 1, "num_shared_experts": 1,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "sliding_window": 4, "window_size": 4, "attention_window_size": 4,
    "first_k_dense_replace": 1,
    # the gated-delta layers' causal convolution (Qwen3-Next / Qwen3.5: 4); a kernel of 1 keeps no state, and
    # upstream slices its state with ``[-(kernel - 1):]``, which is the whole input at 1
    "linear_conv_kernel_dim": 4,
}
TINY.update(
    {
        "partial_rotary_factor": 0.5, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "layer_norm_eps": 1e-5,
        "norm_eps": 1e-5, "layer_norm_epsilon": 1e-5, "norm_epsilon": 1e-5,
        "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16, "laurel_rank": 4,
        "num_kv_shared_layers": 1, "full_attention_interval": 2, "eos_token_id": 1,
        # gemma3n indexes its AltUp streams with the active one (a required int each: 1 and 1 would read past them)
        "altup_num_inputs": 2, "altup_active_idx": 0,
    }
)
#: Per-layer lists (``layer_types`` ...): element values by element type; layer types by the names HF configs use.
PER_LAYER: dict[str, list[Any]] = {
    "str": ["sliding_attention", "full_attention"], "float": [0.0], "int": [0], "bool": [False]
}
#: Values for required fields the table does not name, by annotation (containers first: ``List[int]`` is a list).
BY_TYPE: dict[str, Any] = {"list": [], "dict": {}, "tuple": (), "int": 1, "float": 1.0, "bool": False, "str": ""}
# fmt: on
#: Nested configs (``text_config`` ...): the module's config class whose name holds the word, filled the same way.
NESTED = {"text_config": "Text", "vision_config": "Vision", "audio_config": "Audio"}
PROMPTS = (5, 2, 4)  # left-padded to 5
#: Above this the config did not come out tiny (a nested config the table cannot shrink): not covered.
MAX_PARAMETERS = 2_000_000
STEPS = 3  # generated tokens compared per prompt


@dataclass
class Report:
    caught: list[Caught] = field(default_factory=list)
    covered: list[str] = field(default_factory=list)
    not_covered: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def architectures(package: str) -> list[str]:
    try:
        root = importlib.import_module(package)
    except ImportError:
        return []
    return sorted(info.name for info in pkgutil.iter_modules(root.__path__) if not info.name.startswith("_"))


def tiny(config_cls: Any, model_type: str, module: Any = None) -> dict[str, Any]:
    """Keyword arguments for a tiny ``config_cls`` (of ``module``, where nested config classes are looked up)."""
    fields: dict[str, Any] = (
        {f.name: f for f in dataclasses.fields(config_cls)} if dataclasses.is_dataclass(config_cls) else {}
    )
    if not fields:
        fields = {n: p for n, p in inspect.signature(config_cls).parameters.items() if n != "self"}
    out: dict[str, Any] = {}
    for name, f in fields.items():
        required = _required(f)
        if name == "model_type":
            out[name] = model_type
        elif name in NESTED and (required or _is_dict(f)):
            out[name] = _nested(module, NESTED[name], model_type)
        elif name in TINY:
            out[name] = TINY[name]
        elif required:
            annotation = str(getattr(f, "type", getattr(f, "annotation", ""))).lower()
            out[name] = next((v for k, v in BY_TYPE.items() if k in annotation), 1)
            if annotation.startswith(("list", "typing.list")):
                out[name] = _per_layer(annotation, TINY["num_hidden_layers"])
        else:
            rope = _default(f)
            if isinstance(rope, dict) and "mrope_section" in rope:
                out[name] = _mrope(rope, out.get("head_dim", TINY["head_dim"]), out.get("partial_rotary_factor"))
    return out


def _default(f: Any) -> Any:
    if isinstance(f, dataclasses.Field):
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return None if f.default is dataclasses.MISSING else f.default
    return None


def _mrope(rope: dict[str, Any], head_dim: int, partial: float | None) -> dict[str, Any]:
    """Rope parameters whose multimodal sections (which must add up to half the rotary dimension) fit the tiny head
    dimension, split in the proportions of the defaults."""
    half = int(head_dim * (rope.get("partial_rotary_factor") or partial or 1.0)) // 2
    sections = list(rope["mrope_section"])
    scaled = [max(1, half * s // sum(sections)) for s in sections]
    scaled[0] += half - sum(scaled)
    return {**rope, "mrope_section": scaled}


def _per_layer(annotation: str, layers: int) -> list[Any]:
    """A required list, taken to be one entry per layer: cycling the values its element type gets."""
    inner = annotation.split("[", 1)[-1]
    values = next((v for k, v in PER_LAYER.items() if inner.startswith(k)), [0])
    return [values[i % len(values)] for i in range(layers)]


def _is_dict(f: Any) -> bool:
    return "dict" in str(getattr(f, "type", "")).lower()


def _nested(module: Any, word: str, model_type: str) -> dict[str, Any]:
    """A tiny nested config: the module's ``*<word>*`` config class filled like the outer one, else the table."""
    for name, obj in vars(module or object).items():
        if word in name and dataclasses.is_dataclass(obj) and isinstance(obj, type):
            fields = tiny(obj, model_type, module)
            own = {f.name: f for f in dataclasses.fields(obj)}.get("model_type")
            if word != "Text" and own is not None and not _required(own):
                del fields["model_type"]  # a vision or audio tower keeps its own (towers dispatch on it)
            return {**TINY, **fields}
    return {**TINY, "model_type": model_type}


def _required(f: Any) -> bool:
    if isinstance(f, dataclasses.Field):
        return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    return f.default is inspect.Parameter.empty


def _logits(output: Any) -> Any:
    return getattr(output, "logits", output)


class Driver:
    """One distribution's batch path, within a deadline."""

    def __init__(self, dist: str, deadline: float, seed: int) -> None:
        self.dist = dist
        self.deadline = deadline
        self.seed = seed

    def prompts(self, vocab: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [[rng.randrange(1, vocab) for _ in range(n)] for n in PROMPTS]


def _fail(
    arch: str, invariant: str, detail: str, script: list[str], head: list[str], error: str | None = None
) -> Caught:
    violation = Violation(invariant, detail, "batched generation", (), arch, error=error)
    dist = arch.split(".", 1)[0]
    # The modules whose patches may bear on it: the architecture's own, the caches, the attention, the batch path.
    modules = [m for m in _modules(head) if m.startswith(arch)] + [f"{dist}.models.cache", f"{dist}.models.base"]
    modules += [m for m in _modules(head) if ".generate" in m] + (["mlx_vlm.turboquant"] if dist == "mlx_vlm" else [])
    # an mlx-vlm architecture is a package: its model's forward pass reaches every module of it (language, vision)
    spec = importlib.util.find_spec(arch)
    modules += [f"{arch}.{m.name}" for m in pkgutil.iter_modules((spec and spec.submodule_search_locations) or [])]
    return Caught(violation, head, script, list(dict.fromkeys(modules)))


def _modules(head: list[str]) -> list[str]:
    out = []
    for line in head:
        words = line.split()
        if len(words) > 3 and words[0] == "from" and words[2] == "import":
            name = words[1] + ("." + words[3] if words[1].endswith(".models") else "")
            out.append(name)
    return out


def lm_model(arch: str) -> tuple[list[str], dict[str, Any]]:
    """The header and the config of a tiny mlx-lm ``arch`` (raises where it cannot be built)."""
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    args = tiny(module.ModelArgs, arch, module)
    head = [
        "import mlx.core as mx",
        f"from mlx_lm.models import {arch} as arch"
        if arch.isidentifier()
        else f"arch = __import__('importlib').import_module('mlx_lm.models.{arch}')",
        "from mlx_lm.generate import BatchGenerator, generate_step",
    ]
    return head, args


def lm_lines(args: dict[str, Any], prompts: list[list[int]]) -> list[str]:
    """The reproduction of one mlx-lm architecture: BatchGenerator against generate_step on each prompt alone, each
    run on a model of its own (the same weights: the same seed)."""
    return [
        f"def make():\n    mx.random.seed(0)\n    return arch.Model(arch.ModelArgs(**{args!r}))",
        "model = make()",
        f"prompts = {prompts!r}",
        f"gen = BatchGenerator(model, max_tokens={STEPS}, completion_batch_size=3, prefill_batch_size=3)",
        "uids = gen.insert(prompts)",
        "batched = {u: [] for u in uids}",
        f"while min(len(v) for v in batched.values()) < {STEPS}:",
        "    for r in gen.next_generated() if hasattr(gen, 'next_generated') else gen.next():",
        "        batched[r.uid].append((r.token, r.logprobs))",
        "pairs = []",
        "for u, p in zip(uids, prompts):",
        f"    for (t, got), (w, want) in zip(batched[u], generate_step(mx.array(p), make(), max_tokens={STEPS})):",
        "        pairs.append((got, want))",
        "        if t != int(w):",
        "            break  # past a different token the contexts differ",
    ]


def vlm_model(arch: str, generator: bool = True) -> tuple[list[str], dict[str, Any]]:
    """The header and the configs of a tiny mlx-vlm ``arch`` language model (raises where it cannot): its
    ``TextConfig`` (else its ``ModelConfig``), and the ``ModelConfig`` too where the language model takes both (then,
    with ``generator``, it is driven through mlx-vlm's ``BatchGenerator`` where the release's takes prompt kwargs)."""
    config = importlib.import_module(f"mlx_vlm.models.{arch}.config")
    language = importlib.import_module(f"mlx_vlm.models.{arch}.language")
    text_cls = "TextConfig" if hasattr(config, "TextConfig") else "ModelConfig"
    args: dict[str, Any] = {"cls": text_cls, "text": tiny(getattr(config, text_cls), arch, config)}
    names = [text_cls]
    # a padded prompt's mask where the model takes one (mRoPE models derive their prompt positions from it, as
    # Hugging Face's get_rope_index does: upstream's contract for a left-padded batch)
    args["masked"] = "attention_mask" in inspect.signature(language.LanguageModel.__call__).parameters
    if text_cls == "TextConfig" and len(inspect.signature(language.LanguageModel).parameters) > 1:
        args["model"] = {**tiny(config.ModelConfig, arch, config), "text_config": args["text"]}
        # as mlx-vlm's loader does: the nested configs become objects of their classes
        args["nested"] = {
            field: cls
            for field, word in NESTED.items()
            if field in args["model"] and (cls := f"{word}Config") in vars(config) and field != "text_config"
        }
        names += ["ModelConfig", *args["nested"].values()]
    maker = _vlm_make_cache()
    head = [
        "import mlx.core as mx",
        f"from mlx_vlm.models.{arch}.config import {', '.join(names)}",
        f"from mlx_vlm.models.{arch}.language import LanguageModel",
        "from mlx_vlm.models.cache import make_prompt_cache",
        f"from {maker} import _make_cache",
    ]
    args["generator"] = generator and "model" in args and _takes_prompt_kwargs(maker)
    if args["generator"]:
        head[2] = f"from mlx_vlm.models.{arch} import Model"
        head[-1] = f"from {maker} import BatchGenerator"
    return head, args


def _takes_prompt_kwargs(module: str) -> bool:
    """Whether this release's mlx-vlm ``BatchGenerator`` takes each prompt's kwargs (0.5.0 on)."""
    generator = getattr(importlib.import_module(module), "BatchGenerator", None)
    return generator is not None and "prompt_kwargs" in inspect.signature(generator.insert).parameters


def _vlm_make_cache() -> str:
    for name in ("mlx_vlm.generate.ar", "mlx_vlm.generate"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "_make_cache"):
            return name
    raise ImportError("this mlx-vlm has no _make_cache (no batch path)", name="mlx_vlm.generate")


def vlm_lines(args: dict[str, Any], prompts: list[list[int]]) -> list[str]:
    """The reproduction of one mlx-vlm language model: the batch caches of its batch path against each prompt alone
    (``make_prompt_cache``), each run on a model of its own (the same weights: models keep rope state)."""
    text = f"{args['cls']}(**{args['text']!r})"
    if "model" not in args:
        build = f"    return LanguageModel({text})"
    else:
        build = f"    config = ModelConfig.from_dict({args['model']!r})\n    config.text_config = {text}\n"
        build += "".join(
            f"    config.{field} = {cls}.from_dict({args['model'][field]!r})\n" for field, cls in args["nested"].items()
        )
        made = "Model(config)" if args.get("generator") else "LanguageModel(config.text_config, config)"
        build += f"    return {made}"
    if args.get("generator"):
        return _vlm_generator_lines(build, prompts, int(args["text"].get("vocab_size", TINY["vocab_size"])))
    mask = ", attention_mask=mx.arange(batch.shape[1]) >= mx.array(pad)[:, None]" if args["masked"] else ""
    return [
        f"def make():\n    mx.random.seed(0)\n{build}",
        "model = make()",
        f"prompts = {prompts!r}",
        "pad = [max(map(len, prompts)) - len(p) for p in prompts]",
        "cache = _make_cache(model, pad)",
        "logits = lambda out: getattr(out, 'logits', out)",
        "batch = mx.array([[0] * n + p for n, p in zip(pad, prompts)])",
        f"out = logits(model(batch, cache=cache{mask}))[:, -1]",
        "alone = [(make(), p) for p in prompts]",
        "caches = [make_prompt_cache(m) for m, _ in alone]",
        "want = [logits(m(mx.array([p]), cache=c))[:, -1] for (m, p), c in zip(alone, caches)]",
        "pairs = [(out[i : i + 1], want[i]) for i in range(len(prompts))]",
        f"for t in range({STEPS - 1}):  # decode the batch's own greedy tokens, each row alone too",
        "    nxt = mx.argmax(out, axis=-1)",
        "    out = logits(model(nxt[:, None], cache=cache))[:, -1]",
        "    want = [logits(m(nxt[i : i + 1, None], cache=c))[:, -1]",
        "            for i, ((m, _), c) in enumerate(zip(alone, caches))]",
        "    pairs += [(out[i : i + 1], want[i]) for i in range(len(prompts))]",
    ]


def _vlm_generator_lines(build: str, prompts: list[list[int]], vocab: int) -> list[str]:
    """mlx-vlm's ``BatchGenerator`` on the language model, each prompt's kwargs from ``Model.get_input_embeddings``
    of that prompt alone (as its server hands them over), against the language model on each prompt alone, each run
    on a model of its own (the same weights: the same seed; models keep rope state). Its responses carry the
    log-probabilities of every token (``top_logprobs_k`` is the vocabulary)."""
    return [
        f"def make():\n    mx.random.seed(0)\n{build}",
        "full = make()\nmodel = full.language_model",
        f"prompts = {prompts!r}",
        "logits = lambda out: getattr(out, 'logits', out)",
        "embed = lambda p: full.get_input_embeddings(mx.array([p]), None, mask=mx.ones((1, len(p)), mx.int32))",
        "kwargs = [{k: v for k, v in embed(p).to_dict().items() if v is not None} for p in prompts]",
        "class Stop:  # no stop token: every row generates its tokens",
        "    add_eos_token_ids = reset = lambda self, *a: None",
        "    __call__ = lambda self, *a: False",
        "processor = type('P', (), {'tokenizer': type('T', (), {'stopping_criteria': Stop()})()})()",
        f"gen = BatchGenerator(model, processor, max_tokens={STEPS}, completion_batch_size=3, prefill_batch_size=3,",
        f"                     top_logprobs_k={vocab})",
        f"uids = gen.insert(prompts, {STEPS}, prompt_kwargs=kwargs)",
        "batched = {u: [] for u in uids}",
        "while gen.has_work:",
        "    for r in gen.next()[1]:",
        "        batched[r.uid].append((r.token, mx.array([lp for _, lp in sorted(r.top_logprobs)])))",
        "pairs = []",
        "for u, p in zip(uids, prompts):",
        "    m = make().language_model",
        "    c = make_prompt_cache(m)",
        "    out = logits(m(mx.array([p]), cache=c))[0, -1]",
        "    for t, got in batched[u]:",
        "        pairs.append((got, out - mx.logsumexp(out)))",
        "        if t != int(mx.argmax(out)):",
        "            break  # past a different token the contexts differ",
        "        out = logits(m(mx.array([[t]]), cache=c))[0, -1]",
    ]


def _check(pairs: list[tuple[Any, Any]]) -> tuple[_numbers.Difference | None, list[str]]:
    import mlx.core as mx

    found = _numbers.worst(_numbers.difference(g.reshape(w.shape), w, shift_free=True) for g, w in pairs)
    scale = max(float(mx.abs(w - mx.mean(w)).max().item()) for _, w in pairs)
    bound = _numbers.CLEAR * _numbers.rounding(None, scale)
    check = [
        "err = max(mx.abs(g.reshape(w.shape) - w).max().item() for g, w in pairs)",
        "print('largest difference between a prompt batched and alone (log-probabilities / logits):', err)",
        f"assert err <= {bound:.2g}, err  # {_numbers.CLEAR}x float32 rounding at this magnitude",
    ]
    return found, check


def one(dist: str, arch: str, prompts_of: Driver) -> tuple[Caught | None, str | None]:
    """(the finding, None), (None, None) when the architecture agrees, or (None, why it is not covered)."""
    from .tape import Tape

    build = lm_model if dist == "mlx_lm" else vlm_model
    lines_of = lm_lines if dist == "mlx_lm" else vlm_lines
    try:
        head, args = build(arch)
    except (Exception, SystemExit) as exc:  # a model module may exit on import (a missing optional package)
        return None, _why(exc)
    prompts = prompts_of.prompts(int(args.get("text", args).get("vocab_size", TINY["vocab_size"])))
    while True:
        lines = lines_of(args, prompts)
        setup, drive = lines[:2], lines[2:]
        try:
            tape = Tape(head)
            for line in setup:
                tape.run(line)
            break
        except (Exception, SystemExit) as exc:
            if not args.get("generator"):
                return None, _why(exc)
            # the package's Model (its vision tower) does not build from the tiny config: the language model alone
            head, args = vlm_model(arch, generator=False)
    size = _parameters(tape.value("model"))
    if size > MAX_PARAMETERS:
        return (
            None,
            f"the config is not tiny: {size:,} parameters (fields the tiny config does not name, e.g. a nested config)",
        )
    why = _alone_runs(dist, tape, prompts)
    if why is not None:
        return None, why
    try:
        tape.run("\n".join(drive))
    except Exception as exc:
        text = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return _fail(f"{dist}.models.{arch}", "model-runs", text, setup + drive, head, type(exc).__name__), None
    found, check = _check(tape.value("pairs"))
    if found is not None and found.clear:
        detail = f"a prompt's log-probabilities batched differ from alone by {found}"
        return _fail(f"{dist}.models.{arch}", "logits-agree", detail, setup + drive + check, head), None
    return None, None


def _alone_runs(dist: str, tape: Any, prompts: list[list[int]]) -> str | None:
    """Why the architecture does not even generate alone (then it is not covered), or None. An mlx-vlm language model
    runs on a model of its own: it keeps rope state from a call, and the batch is a fresh model's first one."""
    # generation alone is the prompt and then a token, as the batch side runs it: a crash in the decode step alone is
    # the architecture's (or its tiny config's), never batching's
    line = (
        "_ = [x for _, x in zip(range(2), generate_step(mx.array(prompts[0]), model))]"
        if dist == "mlx_lm"
        else "_m = make()\n_m = getattr(_m, 'language_model', _m)\n_c = make_prompt_cache(_m)\n"
        "_ = [_m(mx.array([p]), cache=_c) for p in (prompts[0], prompts[0][:1])]"
    )
    mark = len(tape.lines)
    try:
        tape.run(f"prompts = {prompts!r}")
        tape.run(line)
    except Exception as exc:
        return "does not run alone: " + _why(exc)
    finally:
        del tape.lines[mark:]
    return None


def _parameters(model: Any) -> int:
    """Parameters of a model, without evaluating them."""
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(model.parameters()))


def _why(exc: BaseException) -> str:
    return (traceback.format_exception_only(type(exc), exc)[-1].strip())[:300]


def hunt(
    dists: tuple[str, ...],
    seconds: float,
    *,
    seed: int = 0,
    skip: tuple[str, ...] = (),
    match: str = "",
    begin: Any = None,
    done: Any = None,
) -> Report:
    """Every architecture of ``dists`` (import names) whose module matches ``match`` (a regular expression), in a
    seed-dependent order, until ``seconds`` are spent.
    ``begin(name)`` is called before each and ``done(name, caught, why)`` after (a process that dies in one is
    restarted by the parent with it in ``skip``)."""
    report = Report()
    deadline = time.monotonic() + seconds
    for dist in dists:
        why = _no_batch_path(dist)
        if why is not None:
            report.not_covered[f"{dist}.models (every architecture)"] = why
            if done is not None:
                done(f"{dist}.models (every architecture)", None, why)
            continue
        package = f"{dist}.models"
        archs = [a for a in architectures(package) if re.search(match, f"{package}.{a}") and _is_architecture(dist, a)]
        random.Random(seed).shuffle(archs)
        driver = Driver(dist, deadline, seed)
        for arch in archs:
            name = f"{dist}.models.{arch}"
            if time.monotonic() > deadline:
                report.not_covered[name] = "not reached within the budget"
                continue
            if name in skip:
                continue
            if begin is not None:
                begin(name)
            caught, why = one(dist, arch, driver)
            if done is not None:
                done(name, caught, why)
            if why is not None:
                report.not_covered[name] = why
                continue
            report.covered.append(name)
            if caught is not None:
                report.caught.append(caught)
    return report


def _no_batch_path(dist: str) -> str | None:
    """Why this release has no batch path to compare (None when it has one)."""
    try:
        if dist == "mlx_lm":
            from mlx_lm.generate import BatchGenerator  # noqa: F401
        else:
            _vlm_make_cache()
    except ImportError as exc:
        return f"no batch path in this release: {exc}"
    return None


def _is_architecture(dist: str, arch: str) -> bool:
    """A model module (mlx-lm) or package (mlx-vlm), not a helper module such as ``cache`` or ``base``."""
    spec = importlib.util.find_spec(f"{dist}.models.{arch}")
    if spec is None:
        return False
    if dist == "mlx_vlm":
        return spec.submodule_search_locations is not None
    origin = spec.origin or ""
    try:
        with open(origin, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return False
    return "class ModelArgs" in text and "class Model" in text
