"""Decode thousands of tokens through mlx-lm's BatchGenerator on a model with NoPE layers; print figures.

    python nope_decode.py MODEL_DIR TOKENS [ROWS]

A SmolLM3-style model (every 4th layer without RoPE: it never reads the cache's offset) decodes TOKENS
tokens in ROWS rows (default 2) through ``BatchGenerator`` (the engine mlx_lm.server runs), with the
end-of-sequence token banned so nothing stops early. Every 512 tokens it records the process RSS, the
decode time of the last 512 tokens, and the edges of the lazy graph behind the NoPE layer's ``offset``
(``BatchKVCache`` advances it lazily; offset-detach ties it into the graph attention evaluates). At the
end it times evaluating that offset (what ``extract``/``filter`` at request end do). Run with and without
kvpatch (``KVPATCH_DISABLE=offset-detach``); prints one ``RESULT <json>`` line.
"""

from __future__ import annotations

import io
import json
import resource
import sys
import time
from pathlib import Path

WINDOW = 512  # a multiple of the KV buffer's growth step (256): offset-detach ties the offset at each growth


def rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def graph_edges(array) -> int:
    import mlx.core as mx

    buf = io.StringIO()
    mx.export_to_dot(buf, array)
    return buf.getvalue().count("->")


def batch_cache(gen):
    """The decoding batch's caches (private attributes: 0.32.x ``_generation_batch``, older ``active_batch``)."""
    batch = getattr(gen, "_generation_batch", None)
    if batch is not None:
        return batch.prompt_cache
    active = getattr(gen, "active_batch", None)
    return active.cache if active is not None else None


def main(argv: list[str]) -> int:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import BatchGenerator

    model_dir, tokens = argv[0], int(argv[1])
    rows = int(argv[2]) if len(argv) > 2 else 2
    model, tokenizer = mlx_lm.load(model_dir)
    nope = [i for i, use in enumerate(model.args.no_rope_layers) if not use]
    eos = 2

    def no_eos(_tokens, logits):
        return logits - 1e9 * (mx.arange(logits.shape[-1]) == eos)

    gen = BatchGenerator(model, max_tokens=tokens + 10, prefill_step_size=512)
    prompts = [tokenizer.encode(p) for p in ("the water is long and", "a man came to work on")[:rows]]
    uids = gen.insert(prompts, logits_processors=[[no_eos]] * len(prompts))
    produced = 0
    windows = []
    start = time.perf_counter()
    last = start
    base_rss = None
    for _ in range(tokens * 2):
        responses = gen.next()
        if isinstance(responses, tuple):
            responses = responses[1]
        if not responses:
            continue
        produced += 1
        if produced == 20:
            base_rss = rss_mb()
            last = time.perf_counter()
        if produced > 20 and (produced - 20) % WINDOW == 0:
            now = time.perf_counter()
            cache = batch_cache(gen)
            edges, kv = None, 0.0
            if cache is not None:
                edges = graph_edges(cache[nope[0]].offset)
                kv = sum(c.keys.nbytes + c.values.nbytes for c in cache if getattr(c, "keys", None) is not None) / 2**20
            rss = rss_mb()
            windows.append(
                {"tokens": produced, "rss_mb": round(rss, 1), "kv_mb": round(kv, 1), "rss_minus_kv_mb": round(rss - kv, 1),
                 "ms_per_step": round((now - last) * 1000 / WINDOW, 3), "offset_edges": edges}
            )  # fmt: skip
            last = now
        if produced >= tokens:
            break
    cache = batch_cache(gen)
    settle = None
    if cache is not None:
        t = time.perf_counter()
        mx.eval(cache[nope[0]].offset)
        settle = round(time.perf_counter() - t, 4)
    result = {
        "tokens": produced,
        "rows": len(uids),
        "nope_layers": nope,
        "base_rss_mb": base_rss,
        "windows": windows,
        "offset_eval_s": settle,
        "total_s": round(time.perf_counter() - start, 2),
    }
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
