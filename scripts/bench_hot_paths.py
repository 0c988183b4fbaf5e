"""Decode throughput with kvpatch's hot-path patches against the same process without them (a benchmark).

Run it with an upstream release on the path (e.g. inside a matrix bucket). Patched and unpatched runs
alternate in one process (``kvpatch.get_engine().without(...)`` takes the patches out and puts them
back), on a tiny random-weight llama (hidden 64, 2 layers, CPU or Metal, whatever mlx uses):

1. ``update_and_fetch`` of BatchKVCache and BatchRotatingKVCache alone (one decode step per call,
   evaluated);
2. ``mlx_lm.generate.generate_step`` (single sequence: KVCache, which no hot-path patch touches);
   this and any row whose code no toggled patch changes is a noise control: its ratio shows how far
   the machine lets two identical runs differ. Then with an 8-bit KV cache, whose attention goes through
   ``quantized_scaled_dot_product_attention`` (replaced by mask-fill and qsdpa-gqa-batch-mask where they apply).
3. ``mlx_lm.generate.BatchGenerator`` with 4 rows (BatchKVCache), with ``max_kv_size`` where the
   release supports it (BatchRotatingKVCache), and on a tiny hybrid LFM2 (ArraysCache.advance).
4. Where mlx-vlm has them, decode steps of a left-padded 2-row batch through a tiny random ``LanguageModel`` of
   qwen3_5 (``Qwen3_5Attention.__call__``: qwen35-batch-positions) and glm4v_moe (``GLM4VModel.__call__``:
   glm4v-batch-positions), with the batch caches of mlx-vlm's own batch generator (``probe_batch_models.py``).
5. Where mlx-lm has gemma2, ``generate_step`` on a tiny gemma2 (every attention call goes through
   gemma2-batch-mask's replacement; one row, because upstream raises on a batch's per-row mask), and where mlx-vlm
   has its own gemma2, one row's decode steps through its ``LanguageModel`` (vlm-gemma2-batch-mask); a left-padded
   2-row batch through mlx-vlm's falcon_ocr ``LanguageModel`` (falcon-ocr-batch-positions).

Patched and unpatched runs alternate (``scripts/_bench.py``); rounds are added until the 95% confidence
interval of the ratio patched / unpatched is narrower than ``--width`` (default 2%), from ``--rounds`` up to
``--max-rounds``. Two ratios per row, each the geometric mean over rounds with its interval: by the wall
clock, and per CPU-second of this process (less disturbed by other processes on a shared machine). Usage::

    python scripts/bench_hot_paths.py [--rounds 10] [--max-rounds 60] [--tokens 100] [--patch ID ...] [--only NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import Paired, hot_path_ids, run_until

import kvpatch

#: Hot-path cache classes this benchmark knows how to drive directly: (module, class, constructor args).
_CACHE_CLASSES: tuple[tuple[str, str, tuple[Any, ...]], ...] = (
    ("mlx_lm.models.cache", "BatchKVCache", ([1, 0, 2, 0],)),
    ("mlx_lm.models.cache", "BatchRotatingKVCache", (64, [1, 0, 2, 0])),
)


def _tiny_llama(hidden_size: int = 64) -> Any:
    import mlx.core as mx
    from mlx_lm.models import llama

    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden_size,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=97,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _tiny_lfm2() -> Any:
    """A hybrid model: 3 conv layers with ArraysCache (advance() every step) and 1 attention layer."""
    import mlx.core as mx
    from mlx_lm.models import lfm2

    mx.random.seed(0)
    config = dict(
        model_type="lfm2",
        vocab_size=97,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=64,
        block_ff_dim=128,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        rope_theta=10000.0,
        layer_types=["conv", "conv", "full_attention", "conv"],
    )
    model = lfm2.Model(lfm2.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def _update_loop(module: str, name: str, ctor: tuple[Any, ...], steps: int) -> Callable[[], int]:
    import importlib

    import mlx.core as mx

    cls = getattr(importlib.import_module(module), name)
    mx.random.seed(1)
    B = len(ctor[-1])
    prompt = mx.random.normal((B, 2, 4, 16))
    tokens = mx.random.normal((steps, B, 2, 1, 16))
    mx.eval(prompt, tokens)

    def run() -> int:
        cache = cls(*ctor)
        mx.eval(cache.update_and_fetch(prompt, prompt))
        for i in range(steps):
            k, v = cache.update_and_fetch(tokens[i], tokens[i])
            mx.eval(k, v)
        return steps

    return run


def _generate_step(model: Any, tokens: int, **kwargs: Any) -> Callable[[], int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    prompt = mx.array([1, 2, 3, 4, 5, 6, 7, 8])

    def run() -> int:
        n = 0
        for _ in generate_step(prompt, model, max_tokens=tokens, **kwargs):
            n += 1
        return n

    return run


def _batch_generator(model: Any, tokens: int, max_kv_size: int | None = None) -> Callable[[], int]:
    from mlx_lm.generate import BatchGenerator

    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12, 13, 14]]
    kwargs = {"max_tokens": tokens}
    if max_kv_size is not None:
        kwargs["max_kv_size"] = max_kv_size

    def run() -> int:
        gen = BatchGenerator(model, **kwargs)
        gen.insert(prompts, max_tokens=[tokens] * len(prompts))
        step = getattr(gen, "next_generated", None) or gen.next
        n = 0
        while True:
            responses = step()
            if not responses:
                break
            n += len(responses)
        close = getattr(gen, "close", None)
        if close is not None:
            close()
        return n

    return run


def _vlm_decode(model: Any, tokens: int, rows: int = 2) -> Callable[[], int]:
    """Prefill a left-padded batch of ``rows`` (1 or 2) prompts through an mlx-vlm ``LanguageModel``, then ``tokens``
    decode steps (logits evaluated each step)."""
    import mlx.core as mx
    from probe_batch_models import batch_caches

    mx.eval(model.parameters())
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9]][-rows:]
    longest = max(len(p) for p in prompts)
    batch = mx.array([[0] * (longest - len(p)) + p for p in prompts])
    step = mx.array([[3], [4]][-rows:])

    def run() -> int:
        for attribute in ("_position_ids", "_rope_deltas"):  # the last prompt's positions, kept on the model
            setattr(model, attribute, None)
        cache = batch_caches(model, [longest - len(p) for p in prompts])
        mx.eval(model(batch, cache=cache).logits)
        for _ in range(tokens):
            mx.eval(model(step, cache=cache).logits)
        return tokens * len(prompts)

    return run


def compare(label: str, run: Callable[[], int], patch_ids: list[str], args: Any, unit: str = "tok/s") -> None:
    """Alternate patched and unpatched runs until the ratio's 95% interval is narrower than ``args.width``;
    print both sides' median throughput and the ratio with its interval, by the wall clock and per CPU-second."""
    if args.only and not any(word in label for word in args.only):
        return
    engine = kvpatch.get_engine()
    cpu = Paired()
    side = {"off": False}

    @contextlib.contextmanager
    def without() -> Iterator[None]:
        with engine.without(*patch_ids):
            side["off"] = True
            try:
                yield
            finally:
                side["off"] = False

    def timed() -> float:
        wall, proc = time.perf_counter(), time.process_time()
        n = run()
        wall, proc = time.perf_counter() - wall, time.process_time() - proc
        (cpu.off if side["off"] else cpu.on).append(n / proc)
        return n / wall

    run()
    with engine.without(*patch_ids):
        run()  # warm both sides
    result = run_until(
        timed,
        without,
        min_rounds=args.rounds,
        max_rounds=args.max_rounds,
        width=args.width,
        budget_s=args.budget,
    )
    r, lo, hi = cpu.ratio()
    print(f"{label:<42} wall: {result.describe(unit)}", flush=True)
    print(f"{'':<42} per CPU-s: ratio {r:.4f} [95% CI {lo:.4f}, {hi:.4f}]", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds at least")
    parser.add_argument("--max-rounds", type=int, default=60)
    parser.add_argument("--width", type=float, default=0.02, help="stop once the ratio's 95%% CI is this narrow")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds per row (after --rounds)")
    parser.add_argument("--only", action="append", default=None, help="run only rows whose label has this word")
    parser.add_argument("--tokens", type=int, default=100, help="tokens generated per row per run")
    parser.add_argument(
        "--patch", action="append", default=None, help="patch id to toggle (default: every installed hot-path patch)"
    )
    args = parser.parse_args()

    import mlx.core as mx
    import mlx_lm
    import mlx_lm.generate  # imports the cache module, so the engine installs its patches
    import mlx_lm.models.base  # (older releases import it only with a model)

    vlm_models = [name for name in ("qwen3_5", "glm4v_moe") if _importable(f"mlx_vlm.models.{name}.language")]
    gemma2 = _importable("mlx_lm.models.gemma2")

    engine = kvpatch.get_engine()
    ids = hot_path_ids(engine, args.patch)
    print(f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, device {mx.default_device()}")
    for pid in ids:
        st = engine.status[pid]
        print(f"  {pid}: {st.state.value}; {', '.join(t.path for t in st.installed) or 'nothing installed'}")
    if not ids:
        print("no hot-path patch is installed here: nothing to compare")
        return 0

    import importlib.util

    for module, name, ctor in _CACHE_CLASSES:
        if getattr(importlib.import_module(module), name, None) is not None:
            run = _update_loop(module, name, ctor, 300)
            compare(f"{name}.update_and_fetch + eval", run, ids, args, "calls/s")
    model = _tiny_llama()
    compare("generate_step (1 row, KVCache)", _generate_step(model, args.tokens), ids, args)
    from mlx_lm.generate import generate_step

    if "kv_bits" in inspect.signature(generate_step).parameters:
        # every layer's attention through quantized_scaled_dot_product_attention (mask-fill, qsdpa-gqa-batch-mask)
        quantized = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}  # head_dim 32
        run = _generate_step(_tiny_llama(hidden_size=128), args.tokens, **quantized)
        compare("generate_step (1 row, 8-bit KV cache)", run, ids, args)
    # the module: mlx_lm.generate, read as an attribute, is the generate() function mlx_lm exports
    BatchGenerator = getattr(sys.modules["mlx_lm.generate"], "BatchGenerator", None)  # mlx-lm >= 0.24
    if BatchGenerator is not None:
        compare("BatchGenerator (4 rows, BatchKVCache)", _batch_generator(model, args.tokens), ids, args)
    if BatchGenerator is not None and "max_kv_size" in inspect.signature(BatchGenerator).parameters:
        run = _batch_generator(model, args.tokens, max_kv_size=64)
        compare("BatchGenerator (4 rows, max_kv_size=64)", run, ids, args)
    if BatchGenerator is not None and importlib.util.find_spec("mlx_lm.models.lfm2") is not None:
        run = _batch_generator(_tiny_lfm2(), args.tokens)
        compare("BatchGenerator (4 rows, LFM2 hybrid)", run, ids, args)
    if gemma2:
        # every gemma2 attention call goes through gemma2-batch-mask's replacement; one row is the path upstream
        # runs too (a batch gets a per-row mask, on which upstream raises: the bug)
        from kvpatch.patches.mlx_lm.gemma2_batch_mask import tiny_model

        compare("generate_step (1 row, gemma2)", _generate_step(tiny_model(), args.tokens), ids, args)
    from probe_batch_models import tiny

    for name in vlm_models:
        mx.random.seed(0)
        compare(f"mlx-vlm {name} LanguageModel decode (2 rows)", _vlm_decode(tiny(name, 8), args.tokens), ids, args)
    if _importable("mlx_vlm.models.gemma2.language"):
        # vlm-gemma2-batch-mask's replacement on every attention call; one row, as for mlx-lm's gemma2
        from kvpatch.patches.mlx_vlm.gemma2_batch_mask import tiny_model as vlm_gemma2

        compare("mlx-vlm gemma2 LanguageModel decode (1 row)", _vlm_decode(vlm_gemma2(), args.tokens, 1), ids, args)
    if _importable("mlx_vlm.models.falcon_ocr.language"):
        # falcon-ocr-batch-positions' replacement on every forward pass of a batch
        from kvpatch.patches.mlx_vlm.falcon_ocr_batch_positions import tiny_model as falcon_ocr

        compare("mlx-vlm falcon_ocr LanguageModel decode (2 rows)", _vlm_decode(falcon_ocr(), args.tokens), ids, args)
    return 0


def _importable(module: str) -> bool:
    """Imports ``module`` (so the engine installs the patches on it) if its distribution is here."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception:  # absent, or (mlx-vlm 0.6.0-0.6.3's qwen3_5) a Metal kernel built at import without Metal
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
