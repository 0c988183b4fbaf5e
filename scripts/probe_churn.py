"""Pending graph edges on a batch cache's metadata under membership churn (a probe, not a test).

Each cycle extends the batch by one primed row, runs one decode step (keys and values evaluated) and filters
the oldest row out, as a server does when requests come and go; it prints the edges pending on ``offset`` /
``left_padding`` / ``lengths`` after 10, 200, 500 and 1,000 cycles::

    .venv/bin/python scripts/in_bucket.py lm-0.32.2 -- python scripts/probe_churn.py lm kv,rot,arrays,list
    KVPATCH=off .venv/bin/python scripts/in_bucket.py lm-0.32.2 -- python scripts/probe_churn.py lm kv,rot,arrays,list

``lm`` / ``vlm``: which distribution's cache module; kinds: kv, rot, arrays, quant, tq, list (a CacheList).
"""

import sys

import mlx.core as mx

from kvpatch.patches._lazy import graph_edges

NAMES = ("offset", "left_padding", "lengths", "_lengths", "_right_padding", "_offset", "_idx")


def meta(cache):
    out = []
    for c in getattr(cache, "caches", None) or [cache]:
        for n in NAMES:
            a = getattr(c, n, None)
            if isinstance(a, mx.array):
                out.append(a)
    return out


def edges(cache):
    return sum(graph_edges(a) for a in meta(cache))


def run(mod, kind, cycles=1000, B=3):
    H, D = 2, 64
    key = mx.random.key(0)

    def kv(b, n):
        return mx.random.normal((b, H, n, D), key=key)

    def make(b, kind):
        if kind == "kv":
            return mod.BatchKVCache([0] * b)
        if kind == "rot":
            return mod.BatchRotatingKVCache(64, [0] * b)
        if kind == "arrays":
            c = mod.ArraysCache(2, left_padding=[0] * b)
            return c
        if kind == "quant":
            return mod.BatchQuantizedKVCache([0] * b, group_size=64, bits=8)
        if kind == "tq":
            import mlx_vlm.turboquant as tq

            return tq.BatchTurboQuantKVCache([0] * b, bits=3)
        if kind == "list":
            return mod.CacheList(mod.ArraysCache(2, left_padding=[0] * b), mod.BatchKVCache([0] * b))

    def prime(c, b):
        for sub in getattr(c, "caches", None) or [c]:
            if isinstance(sub, mod.ArraysCache):
                sub[0] = mx.zeros((b, 3, 4))
                sub[1] = mx.zeros((b, 4, 4))
                mx.eval(sub.cache)
            else:
                from kvpatch.patches.mlx_vlm.offset_detach import arrays

                mx.eval(arrays(sub.update_and_fetch(kv(b, 3), kv(b, 3))))

    def step(c, b):
        outs = []
        for sub in getattr(c, "caches", None) or [c]:
            if isinstance(sub, mod.ArraysCache):
                sub[0] = sub[0] * 0.5 + 1
                sub[1] = sub[1] * 0.5 + 1
                sub.advance(1)
                outs += [sub[0], sub[1]]
            else:
                outs += list(sub.update_and_fetch(kv(b, 1), kv(b, 1)))
        from kvpatch.patches.mlx_vlm.offset_detach import arrays

        mx.eval(arrays(outs))

    batch = make(B, kind)
    prime(batch, B)
    res = {}
    for i in range(1, cycles + 1):
        row = make(1, kind)
        prime(row, 1)
        batch.extend(row)
        step(batch, B + 1)
        batch.filter(mx.arange(1, B + 1))
        if i in (10, 200, 500, 1000):
            res[i] = edges(batch)
    return res


if __name__ == "__main__":
    which = sys.argv[1]
    if which == "lm":
        import mlx_lm.models.cache as mod
    else:
        import mlx_vlm.models.cache as mod
    for kind in sys.argv[2].split(","):
        try:
            print(kind, run(mod, kind, int(sys.argv[3]) if len(sys.argv) > 3 else 1000), flush=True)
        except Exception as e:
            print(kind, "error", type(e).__name__, e, flush=True)
