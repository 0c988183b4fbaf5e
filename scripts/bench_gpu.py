"""Decode throughput on a GPU with kvpatch's hot-path patches in and out (a benchmark a user can rerun).

Two random-weight bfloat16 models of realistic size, no downloads:

* ``llama``: a ~1.0B-parameter llama (hidden 2048, 16 layers, 32 query / 8 KV heads, MLP 8192, vocab
  32000), the shape of Llama-3.2-1B;
* ``hybrid``: a ~1.1B LFM2-style hybrid (hidden 2048, 16 layers: 11 short-convolution layers with
  ``ArraysCache`` and 5 attention layers; LFM2-1.2B itself has 10 and 6).

Each is decoded with mlx-lm's ``BatchGenerator`` at batch 1, 8 and 32 (prompts of 32 tokens, then
``--tokens`` tokens per row). Only decode is timed: the clock starts once every row is generating and
stops after the last token (``mx.synchronize``). Patched and unpatched runs alternate in one process
(``kvpatch.get_engine().without(...)`` takes every installed hot-path patch out and puts it back); rounds
are added until the 95% confidence interval of the ratio patched / unpatched is narrower than ``--width``
(default 1%), or ``--max-rounds``. Prints the device, the versions, absolute tokens/s of both sides and the
ratio with its interval. Usage (any mlx backend; meant for CUDA)::

    USE_TORCH=0 python scripts/bench_gpu.py [--models llama,hybrid] [--batches 1,8,32] [--tokens 64]
    USE_TORCH=0 python scripts/bench_gpu.py --interleave 20 --tokens 512   # docs/performance.md's figures
    python scripts/bench_gpu.py --pool RUN.json [RUN.json ...]              # runs written by --json, pooled

``--interleave K`` pairs at a finer grain: inside each generation the patches go out and back in between decode
steps, ``--settle S`` steps run unclocked after each switch (default 11), then a block of K steps is timed; a
pair is a patched block and the unpatched block next to it (which goes first alternates). Decode speed on a GPU
host drifts by 10-15% between whole runs; adjacent blocks of one run share that drift. The settling steps
mattered for arrays-advance-detach's versions before 2026-11-26, which kept per-cache books: a patch put back was a
new installation, its 10th call (kvpatch's tie period) anchored each cache's metadata, and the next step evaluated
the anchor, the whole chain of decrements the unpatched block left pending (in the hybrid at batch 1, ~900 graph
nodes more in that one step, against ~1560 in every other). With ``--settle 10`` a timed block contained that
step, charging the patch with the switch, and the hybrid measured 0.92-0.95 (H100, 2026-11-25/26).
``python scripts/graph_nodes.py --interleave 20 --settle S`` counts the timed blocks' nodes. The current version
keeps no period; ``offset-detach`` ties every 10th write position whatever the installation, so S = 11 is still
the default (a timed block of 20 holds two of its ties). The hot-path patches tie or defer lazy cache metadata
or fix edge cases of methods called per step, so switching between steps changes no token here (the outputs
are not compared). Each row also prints the median of the pairs' ratios with its distribution-free 95% interval
(order statistics): single blocks on an H100 varied by 10-14% with heavy tails, which widen the mean's interval
far more than the median's; ``--stat median`` stops on that interval instead.
``--json PATH`` writes every pair (tokens/s of both sides, and the spacing of each block's steps) with the
settings, for analysis beyond the printed interval. ``bench_gpu.py --pool A.json B.json ...`` pools the pairs of
runs made with the same settings on the same device and versions (refused otherwise) and prints the same rows:
a run cut short by the device's time limit can be completed by another.

Decode-only timing favours upstream where a patch fixes a leak: upstream's ``ArraysCache.advance`` leaves its
lazy decrements in the caches no layer reads, and frees them only when the caches are discarded, outside the
clock (``arrays-advance-detach`` before 2026-11-26 freed them every 10th step, inside it; now it builds none).
``--teardown`` (whole runs, without
``--interleave``) stops the clock after the generator and its caches are discarded, so both sides pay for
the nodes they free.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import Paired, hot_path_ids, run_until

import kvpatch
from kvpatch.patches._lazy import EVERY

LLAMA_1B = dict(
    model_type="llama",
    hidden_size=2048,
    num_hidden_layers=16,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    rms_norm_eps=1e-5,
    vocab_size=32000,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)

# 11 conv and 5 attention layers (LFM2-1.2B has 10 and 6; kept as measured)
_LFM2_LAYERS = [
    *(["conv", "conv", "full_attention"] * 2),
    *(["conv", "conv", "full_attention", "conv"] * 2),
    *["conv", "full_attention"],
]

LFM2_1B = dict(
    model_type="lfm2",
    vocab_size=32000,
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=4096,
    norm_eps=1e-5,
    conv_bias=False,
    conv_L_cache=3,
    block_dim=2048,
    block_ff_dim=8192,
    block_multiple_of=256,
    block_ffn_dim_multiplier=1.0,
    block_auto_adjust_ff_dim=False,
    rope_theta=1000000.0,
    layer_types=_LFM2_LAYERS,
)


def build(kind: str, small: bool = False) -> Any:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    shrink = dict(hidden_size=256, intermediate_size=512, block_dim=256, block_ff_dim=512) if small else {}
    mx.random.seed(0)
    if kind == "llama":
        from mlx_lm.models import llama

        model = llama.Model(llama.ModelArgs.from_dict({**LLAMA_1B, **shrink}))
    elif kind == "hybrid":
        from mlx_lm.models import lfm2

        assert len(_LFM2_LAYERS) == LFM2_1B["num_hidden_layers"]
        model = lfm2.Model(lfm2.ModelArgs.from_dict({**LFM2_1B, **shrink}))
    else:
        raise SystemExit(f"unknown model {kind!r}")
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    n = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"{kind}: {n / 1e9:.2f}B parameters, bfloat16", flush=True)
    return model


def _prompts(batch: int, prompt_len: int = 32) -> list[list[int]]:
    import mlx.core as mx

    mx.random.seed(1)
    return mx.random.randint(1, 30000, (batch, prompt_len)).tolist()


def _prefilled(model: Any, prompts: list[list[int]], tokens: int) -> tuple[Any, Any]:
    """A BatchGenerator past prefill (every row produced its first token), and its step function."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    batch = len(prompts)
    gen = BatchGenerator(model, max_tokens=tokens, completion_batch_size=batch, prefill_batch_size=batch)
    gen.insert(prompts, max_tokens=[tokens] * batch)
    step = getattr(gen, "next_generated", None) or gen.next
    first = 0
    while first < batch:
        first += len(step())
    mx.synchronize()
    return gen, step


def _close(gen: Any) -> None:
    close = getattr(gen, "close", None)
    if close is not None:
        close()


def decode_run(model: Any, batch: int, tokens: int, teardown: bool = False) -> Any:
    """A closure: one BatchGenerator run; returns decode tokens per second (all rows generating). With
    ``teardown`` the clock also covers closing and discarding the generator, caches included: where a patch
    frees lazy nodes during decoding that upstream leaves in its caches, upstream frees them there."""
    import mlx.core as mx

    prompts = _prompts(batch)

    def run() -> float:
        gen, step = _prefilled(model, prompts, tokens)
        start = time.perf_counter()
        n = 0
        while True:
            responses = step()
            if not responses:
                break
            n += len(responses)
        if teardown:
            _close(gen)
            del gen, step
        mx.synchronize()
        elapsed = time.perf_counter() - start
        if not teardown:
            _close(gen)
        return n / elapsed

    return run


def interleaved_run(
    model: Any, batch: int, tokens: int, block: int, engine: Any, ids: list[str], settle: int = 0
) -> Any:
    """A closure: one BatchGenerator run whose decode steps alternate between patched and unpatched blocks of
    ``block`` steps; returns the pairs of adjacent blocks: (patched tok/s, unpatched tok/s, and each side's
    seconds between consecutive ``step()`` returns: no synchronisation is added, so these are the pipelined
    steps' spacing, for ``--json``)."""
    import contextlib

    import mlx.core as mx

    prompts = _prompts(batch)
    parity = [0]

    def run() -> list[tuple[float, float]]:
        gen, step = _prefilled(model, prompts, tokens)
        parity[0] ^= 1
        patched_first = bool(parity[0])
        rates: list[tuple[bool, float]] = []  # (patched, tokens per second) per block
        done, k = False, 0
        while not done:
            patched = patched_first == (k % 2 == 0)
            with contextlib.ExitStack() as stack:
                if not patched:
                    stack.enter_context(engine.without(*ids))
                for _ in range(settle):  # unclocked: what the switch left behind is dealt with here
                    if not step():
                        done = True
                        break
                if done:
                    break
                mx.synchronize()
                start, n = time.perf_counter(), 0
                ticks = [start]
                for _ in range(block):
                    responses = step()
                    ticks.append(time.perf_counter())
                    if not responses:
                        done = True
                        break
                    n += len(responses)
                mx.synchronize()
                elapsed = time.perf_counter() - start
            if n == batch * block:  # a full block only (the last one may end early)
                rates.append((patched, n / elapsed, [b - a for a, b in itertools.pairwise(ticks)]))
            k += 1
        _close(gen)
        pairs = []
        for a, b in zip(rates[::2], rates[1::2], strict=False):
            on, off = (a, b) if a[0] else (b, a)
            if on[0] and not off[0]:
                pairs.append((on[1], off[1], on[2], off[2]))
        return pairs

    return run


def interleaved_until(
    run: Any, *, min_runs: int, max_runs: int, width: float, budget_s: float, stat: str = "mean"
) -> tuple[Paired, list[tuple[list[float], list[float]]]]:
    """Generations of ``interleaved_run`` until the ratio's 95% interval over all block pairs is narrow enough;
    also returns each pair's step spacings."""
    result = Paired()
    steps: list[tuple[list[float], list[float]]] = []
    start = time.perf_counter()
    for i in range(max_runs):
        for on, off, on_steps, off_steps in run():
            result.on.append(on)
            result.off.append(off)
            steps.append((on_steps, off_steps))
        if i + 1 >= min_runs and result.rounds >= 2:
            if result.width(stat) < width or time.perf_counter() - start > budget_s:
                break
    return result, steps


def device_name() -> str:
    import mlx.core as mx

    info: dict[str, Any] = {}
    for getter in (getattr(mx, "device_info", None), getattr(getattr(mx, "metal", None), "device_info", None)):
        if getter is None:
            continue
        try:
            info = dict(getter())
            break
        except Exception:
            continue
    name = info.get("device_name") or info.get("name") or ""
    return f"{mx.default_device()} {name}".strip()


def paired_row(kind: str, batch: int, result: Paired, how: str) -> str:
    """A row of interleaved pairs: both sides' medians and the mean ratio, then the median ratio's interval."""
    median, lo, hi = result.median_ratio()
    return (
        f"{kind:<7} batch {batch:>3}: {result.describe('tok/s')} {how}\n"
        f"{'':<17}median ratio {median:.4f} [95% CI {lo:.4f}, {hi:.4f}] (distribution-free)"
    )


# what two runs must share for their pairs to be pooled (the device and versions come with each file)
POOL_KEYS = ("device", "mlx", "mlx_lm", "toggled")
POOL_SETTINGS = ("tokens", "interleave", "settle", "small", "tie_every", "teardown")


def pool(paths: list[str]) -> int:
    """``--pool``: the pairs of several ``--json`` files of one device and one set of settings, per model and
    batch, as one sample. A pair compares adjacent blocks of one run, so runs that drifted apart in absolute speed
    still give comparable pairs. Pool every run made for the row, not a chosen few: choosing runs by their
    result biases the pooled interval."""
    runs: list[dict[str, Any]] = []
    for path in paths:
        try:
            run = json.loads(Path(path).read_text())
            if not isinstance(run, dict) or not {"settings", "configurations"} <= run.keys():
                raise ValueError("no 'settings' and 'configurations' in it")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"cannot read {path} as a file written by --json: {exc!r}", file=sys.stderr)
            return 2
        runs.append(run)
    first = runs[0]
    for path, run in zip(paths, runs, strict=True):
        differ = [k for k in POOL_KEYS if run.get(k) != first.get(k)]
        differ += [k for k in POOL_SETTINGS if run["settings"].get(k) != first["settings"].get(k)]
        if differ:
            print(f"cannot pool {path} with {paths[0]}: they differ in {', '.join(differ)}", file=sys.stderr)
            return 2
    print(f"device: {first['device']}; mlx {first['mlx']}, mlx-lm {first['mlx_lm']}; toggled {first['toggled']}")
    pooled: dict[tuple[str, int], tuple[Paired, list[str]]] = {}
    for path, run in zip(paths, runs, strict=True):
        for conf in run["configurations"]:
            result, sources = pooled.setdefault((conf["model"], conf["batch"]), (Paired(), []))
            result.on.extend(conf["on"])
            result.off.extend(conf["off"])
            sources.append(f"{Path(path).name}: {len(conf['on'])}")
    for (kind, batch), (result, sources) in pooled.items():
        print(paired_row(kind, batch, result, f"pooled ({'; '.join(sources)})"))
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--pool"]:
        if len(sys.argv) < 3:
            print("usage: bench_gpu.py --pool RUN.json [RUN.json ...]  (files written by --json)", file=sys.stderr)
            return 2
        return pool(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,hybrid")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--tokens", type=int, default=64, help="decoded tokens per row per run")
    parser.add_argument("--width", type=float, default=0.01, help="stop when the 95%% CI of the ratio is this narrow")
    parser.add_argument("--min-rounds", type=int, default=8)
    parser.add_argument("--max-rounds", type=int, default=60)
    parser.add_argument("--budget", type=float, default=120.0, help="seconds per configuration (after min-rounds)")
    parser.add_argument("--small", action="store_true", help="hidden 256 instead of 2048 (a smoke test)")
    parser.add_argument("--patch", action="append", default=None, help="patch id to toggle (default: hot-path ones)")
    parser.add_argument(
        "--interleave", type=int, default=0, metavar="K", help="toggle every K decode steps inside each run (pairs)"
    )
    parser.add_argument(
        "--settle",
        type=int,
        default=EVERY + 1,
        metavar="S",
        help=f"with --interleave: decode steps run unclocked after each switch (default {EVERY + 1}: kvpatch's tie "
        "period, plus one)",
    )
    parser.add_argument(
        "--stat",
        choices=("mean", "median"),
        default="mean",
        help="with --interleave: the interval that --width stops on (geometric mean, or median of the pairs)",
    )
    parser.add_argument(
        "--tie-every",
        type=int,
        default=None,
        metavar="N",
        help=f"an experiment: rebuild the toggled patches with kvpatch's tie period N instead of {EVERY} "
        "(offset-detach's family reads it when built; a huge N measures the replacement without its ties)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="write every pair and the settings here")
    parser.add_argument(
        "--teardown",
        action="store_true",
        help="without --interleave: the clock also covers discarding the generator and its caches",
    )
    args = parser.parse_args()

    import mlx.core as mx
    import mlx_lm
    import mlx_lm.generate  # the cache module: the engine installs its patches

    engine = kvpatch.get_engine()
    ids = hot_path_ids(engine, args.patch)
    print(f"device: {device_name()}; {platform.platform()}; Python {platform.python_version()}")
    print(f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, kvpatch {kvpatch.__version__}")
    if args.tie_every is not None:
        from kvpatch.patches import _lazy

        _lazy.EVERY = args.tie_every
        for pid in ids:  # rebuilt now with the new period (builders read it)
            engine.suspend(pid)
            engine.resume(pid)
        print(f"kvpatch's tie period set to {args.tie_every} (an experiment; shipped: {EVERY})")
    for pid in ids:
        st = engine.status[pid]
        print(f"  toggled: {pid}: {st.state.value}; {', '.join(t.path for t in st.installed) or 'nothing installed'}")
    if not ids:
        print("no hot-path patch is installed here: nothing to compare")
        return 0
    print(
        f"decode only, {args.tokens} tokens per row per run, ratio = patched / unpatched tok/s, "
        f"rounds until the 95% CI is narrower than {args.width:.2%}",
        flush=True,
    )
    rows: list[str] = []
    raw: list[dict[str, Any]] = []
    for kind in args.models.split(","):
        model = build(kind, args.small)
        gc.collect()
        gc.freeze()  # the model and everything before it out of the collector's way (a full pass then stays short)
        for batch in (int(b) for b in args.batches.split(",")):
            if args.interleave:
                pairs = interleaved_run(model, batch, args.tokens, args.interleave, engine, ids, args.settle)
                pairs()  # warm both sides (kernels compile on first use)
                result, steps = interleaved_until(
                    pairs,
                    min_runs=args.min_rounds,
                    max_runs=args.max_rounds,
                    width=args.width,
                    budget_s=args.budget,
                    stat=args.stat,
                )
                blocks = f"(pairs of {args.interleave}-step blocks, {args.settle} unclocked steps after each switch)"
                line = paired_row(kind, batch, result, blocks)
                rows.append(line)
                raw.append(dict(model=kind, batch=batch, on=result.on, off=result.off, steps=steps))
                print(line, flush=True)
                continue
            run = decode_run(model, batch, args.tokens, args.teardown)
            run()
            with engine.without(*ids):
                run()  # warm both sides (kernels compile on first use)
            result = run_until(
                run,
                lambda: engine.without(*ids),
                min_rounds=args.min_rounds,
                max_rounds=args.max_rounds,
                width=args.width,
                budget_s=args.budget,
            )
            line = f"{kind:<7} batch {batch:>3}: {result.describe('tok/s')}"
            rows.append(line)
            raw.append(dict(model=kind, batch=batch, on=result.on, off=result.off))
            print(line, flush=True)
        del model
        mx.clear_cache()
        if args.json:
            meta = dict(device=device_name(), mlx=mx.__version__, mlx_lm=mlx_lm.__version__, toggled=ids)
            Path(args.json).write_text(json.dumps(dict(settings=vars(args), **meta, configurations=raw)))
    print("\nsummary")
    for line in rows:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
