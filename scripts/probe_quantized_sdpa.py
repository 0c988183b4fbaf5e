"""Which shapes of mlx-lm's quantized attention the running mlx backend can compute (a probe, run by hand).

mlx-lm's ``quantized_scaled_dot_product_attention`` makes two ``mx.quantized_matmul`` calls: scores =
queries x keys^T (``transpose=True``, K = head_dim, N = keys) and out = scores x values (``transpose=False``,
K = keys, N = head_dim), with the KV-head axis expanded to five axes under grouped-query attention. This probe
runs both products directly, over dtypes, bits, group sizes, head dims and geometries, with keys and values
either fresh (contiguous) or a prefix of a longer buffer (how the quantized caches hand them out), and prints
one line per failing case with mlx's message, then the same cases through mlx-lm's function with kvpatch off
and on. Run with kvpatch installed; ``KVPATCH`` must not be ``off`` (the script takes patches out itself)::

    USE_TORCH=0 python scripts/probe_quantized_sdpa.py [--quick]

``--numbers`` checks what the products *compute* rather than whether they raise: each
``mx.quantized_matmul`` against the same product over the dequantized operands (float32), over query rows M,
key counts S, batch x heads, bits and dtype, one line per case (OK / BAD with the max error / ERR). Kernels
compile on first use, so one dtype and direction per process runs them side by side::

    for t in 1 0; do for d in float32 bfloat16; do
      python scripts/probe_quantized_sdpa.py --numbers --transpose $t --dtype $d > numbers-$t-$d.txt &
    done; done; wait
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from typing import Any


def _quantized(mx: Any, shape: tuple[int, ...], dtype: Any, bits: int, gs: int, sliced: bool, seed: int) -> Any:
    """Quantized keys of ``shape`` (B, H, N, D): fresh, or the first N rows of a 256-row buffer."""
    B, H, N, D = shape
    full = (B, H, max(256, N + 1), D) if sliced else shape
    x = mx.random.normal(full, key=mx.random.key(seed)).astype(dtype)
    q = mx.quantize(x, group_size=gs, bits=bits)
    if sliced:
        # the quantized caches keep a step-sized buffer and return ``buffer[..., :offset, :]``
        q = tuple(a[..., :N, :] for a in q)
    mx.eval(q)
    return q


def _products(mx: Any, geom: tuple[int, ...], dtype: Any, bits: int, gs: int, D: int, sliced: bool) -> list[str]:
    """Both products of one case; a message per product that raises."""
    B, n_kv, n_rep, L, N = geom
    q = mx.random.normal((B, n_kv, n_rep, L, D), key=mx.random.key(1)).astype(dtype)
    keys = _quantized(mx, (B, n_kv, N, D), dtype, bits, gs, sliced, 2)
    values = _quantized(mx, (B, n_kv, N, D), dtype, bits, gs, sliced, 3)
    if n_rep == 1:
        q = q.reshape(B, n_kv, L, D)
    else:
        keys = tuple(mx.expand_dims(a, -3) for a in keys)
        values = tuple(mx.expand_dims(a, -3) for a in values)
    out = []
    try:
        scores = mx.quantized_matmul(q, *keys, transpose=True, group_size=gs, bits=bits)
        mx.eval(scores)
    except (RuntimeError, ValueError) as exc:
        out.append(f"scores: {exc}")
        scores = mx.softmax(mx.random.normal((*q.shape[:-1], N), key=mx.random.key(4)).astype(dtype), axis=-1)
    try:
        mx.eval(mx.quantized_matmul(scores, *values, transpose=False, group_size=gs, bits=bits))
    except (RuntimeError, ValueError) as exc:
        out.append(f"out: {exc}")
    return out


def _sdpa(mx: Any, fn: Any, geom: tuple[int, ...], dtype: Any, bits: int, gs: int, D: int) -> str | None:
    """mlx-lm's function on cache-like (sliced) keys/values with a causal mask; the error or None."""
    B, n_kv, n_rep, L, N = geom
    q = mx.random.normal((B, n_kv * n_rep, L, D), key=mx.random.key(1)).astype(dtype)
    keys = _quantized(mx, (B, n_kv, N, D), dtype, bits, gs, True, 2)
    values = _quantized(mx, (B, n_kv, N, D), dtype, bits, gs, True, 3)
    try:
        mx.eval(fn(q, keys, values, scale=D**-0.5, mask="causal" if L > 1 else None, group_size=gs, bits=bits))
    except (RuntimeError, ValueError) as exc:
        return str(exc)
    return None


def _numbers(mx: Any, transpose: bool, dtype_name: str) -> int:
    """Both attention products through ``mx.quantized_matmul`` against the dequantized float product."""
    dtype, gs, D = getattr(mx, dtype_name), 64, 64
    bad = 0
    for bits, M, S, (B, H) in itertools.product((8, 4), (1, 2, 4, 8), (12, 39, 64, 256), ((1, 1), (1, 2), (3, 2))):
        if bits == 4 and M > 2:
            continue
        if transpose:  # scores: queries (B, H, M, D) x keys (B, H, S, D)^T
            x = mx.random.normal((B, H, M, D), key=mx.random.key(1)).astype(dtype)
        else:  # output: attention weights (B, H, M, S) x values (B, H, S, D)
            x = mx.softmax(mx.random.normal((B, H, M, S), key=mx.random.key(1)), axis=-1).astype(dtype)
        w = _quantized(mx, (B, H, S, D), dtype, bits, gs, False, 2)
        dense = mx.dequantize(*w, group_size=gs, bits=bits).astype(mx.float32)
        ref = x.astype(mx.float32) @ (dense.swapaxes(-1, -2) if transpose else dense)
        scale = max(mx.abs(ref).max().item(), 1.0)
        what = f"transpose={int(transpose)} {dtype_name} bits={bits} M={M} S={S} BxH={B}x{H}"
        try:
            out = mx.quantized_matmul(x, *w, transpose=transpose, group_size=gs, bits=bits)
            err = mx.abs(out.astype(mx.float32) - ref).max().item()
        except (RuntimeError, ValueError) as exc:
            bad += 1
            print(f"ERR {what}: {exc}", flush=True)
            continue
        ok = err <= 2e-2 * scale  # NaN fails too
        bad += not ok
        print(f"{'OK ' if ok else 'BAD'} {what} max error {err:.3g} (reference max {scale:.3g})", flush=True)
    print(f"{bad} wrong or raising", flush=True)
    return 0


def _e2e(mx: Any, engine: Any) -> int:
    """generate_step with a quantized KV cache on random bf16 llamas, with kvpatch's patches and without."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models import llama

    ids = [pid for pid, st in engine.status.items() if st.installed]
    print(f"installed: {ids}", flush=True)
    for head_dim, heads, kv_heads in ((128, 8, 2), (64, 8, 8), (64, 4, 1)):
        args = llama.ModelArgs(
            model_type="llama",
            hidden_size=heads * head_dim,
            num_hidden_layers=2,
            intermediate_size=256,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            rms_norm_eps=1e-5,
            vocab_size=128,
            head_dim=head_dim,
        )
        mx.random.seed(0)
        model = llama.Model(args)
        model.set_dtype(mx.bfloat16)
        mx.eval(model.parameters())
        prompt = mx.array(list(range(1, 40)))
        for kv_bits, kv_gs in ((8, 64), (4, 64), (8, 32), (4, 32)):
            for label in ("patched", "unpatched"):
                try:
                    with engine.without(*(ids if label == "unpatched" else ())):
                        gen = generate_step(
                            prompt, model, max_tokens=8, kv_bits=kv_bits, kv_group_size=kv_gs, quantized_kv_start=0
                        )
                        res = f"ok {[int(t) for t, _ in gen]}"
                except (RuntimeError, ValueError) as exc:
                    res = f"raises {exc}"
                print(f"generate_step D={head_dim} {heads}q/{kv_heads}kv kv_bits={kv_bits} gs={kv_gs} {label}: {res}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="bfloat16 and float32, group size 64 only")
    parser.add_argument("--e2e", action="store_true", help="only generate_step with kv_bits, kvpatch on and off")
    parser.add_argument("--numbers", action="store_true", help="only: are the products' results right")
    parser.add_argument("--transpose", type=int, default=1, choices=(0, 1), help="--numbers: which product")
    parser.add_argument("--dtype", default="float32", help="--numbers: float32, bfloat16 or float16")
    args = parser.parse_args()

    import mlx.core as mx
    from mlx_lm.models import base

    import kvpatch

    print(f"mlx {mx.__version__}, device {mx.default_device()}", flush=True)
    if args.numbers:
        return _numbers(mx, bool(args.transpose), args.dtype)
    if args.e2e:
        return _e2e(mx, kvpatch.get_engine())
    dtypes = [mx.bfloat16, mx.float32] + ([] if args.quick else [mx.float16])
    bits_gs = [(8, 64), (4, 64)] + ([] if args.quick else [(8, 32), (4, 32), (8, 128)])
    dims = [64, 128] + ([] if args.quick else [80])
    geoms = [
        (1, 2, 4, 1, 39),  # GQA decode, one row
        (1, 2, 4, 39, 39),  # GQA prefill
        (1, 8, 1, 1, 39),  # MHA decode
        (1, 1, 1, 1, 7),  # one head
        (2, 1, 4, 3, 7),  # two rows, one KV head
        (2, 2, 4, 3, 7),
        (4, 2, 4, 1, 100),  # a batch decoding
        (1, 2, 1, 1, 7),  # MHA, M*B < 8
    ]
    fails = total = 0
    t0 = time.perf_counter()
    for dtype, (bits, gs), D, geom, sliced in itertools.product(dtypes, bits_gs, dims, geoms, (False, True)):
        if D % gs:
            continue
        total += 1
        problems = _products(mx, geom, dtype, bits, gs, D, sliced)
        for p in problems:
            fails += 1
            B, n_kv, n_rep, L, N = geom
            print(
                f"FAIL {dtype} bits={bits} gs={gs} D={D} B={B} kv={n_kv} rep={n_rep} L={L} N={N} "
                f"{'sliced' if sliced else 'fresh'}: {p}",
                flush=True,
            )
    print(f"direct products: {fails} failures in {total} cases ({time.perf_counter() - t0:.1f} s)", flush=True)

    engine = kvpatch.get_engine()
    fn = base.quantized_scaled_dot_product_attention
    installed = [pid for pid, st in engine.status.items() if st.installed and "models.base" in str(st.installed)]
    print(f"mlx-lm quantized SDPA, patches on it: {installed or 'none'}", flush=True)
    for dtype, (bits, gs), D, geom in itertools.product(dtypes, bits_gs, dims, geoms):
        if D % gs:
            continue
        with engine.without(*installed):
            off = _sdpa(mx, base.quantized_scaled_dot_product_attention, geom, dtype, bits, gs, D)
        on = _sdpa(mx, base.quantized_scaled_dot_product_attention, geom, dtype, bits, gs, D)
        if off or on:
            print(
                f"SDPA {dtype} bits={bits} gs={gs} D={D} geom={geom}: off: {off or 'ok'} | on: {on or 'ok'}", flush=True
            )

    # A candidate routing: contiguous keys/values (the caches hand out prefixes of a longer buffer).
    def contiguous(original: Any) -> Any:
        def wrapped(queries, q_keys, q_values, scale, mask, group_size=64, bits=8):  # type: ignore[no-untyped-def]
            q_keys = tuple(mx.contiguous(a) for a in q_keys)
            q_values = tuple(mx.contiguous(a) for a in q_values)
            return original(queries, q_keys, q_values, scale, mask, group_size, bits)

        return wrapped

    cand = contiguous(fn)
    bad = 0
    for dtype, (bits, gs), D, geom in itertools.product(dtypes, bits_gs, dims, geoms):
        if D % gs:
            continue
        err = _sdpa(mx, cand, geom, dtype, bits, gs, D)
        if err:
            bad += 1
            print(f"CANDIDATE contiguous FAILS {dtype} bits={bits} gs={gs} D={D} geom={geom}: {err}", flush=True)
    print(f"candidate (contiguous keys/values): {bad} failures", flush=True)

    # End to end: generate_step with a quantized cache on random bf16 llamas, unpatched and with the candidate.
    from mlx_lm.generate import generate_step
    from mlx_lm.models import llama

    for head_dim, heads, kv_heads in ((128, 8, 2), (64, 8, 8)):
        args = llama.ModelArgs(
            model_type="llama",
            hidden_size=heads * head_dim,
            num_hidden_layers=2,
            intermediate_size=256,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            rms_norm_eps=1e-5,
            vocab_size=128,
            head_dim=head_dim,
        )
        mx.random.seed(0)
        model = llama.Model(args)
        model.set_dtype(mx.bfloat16)
        mx.eval(model.parameters())
        prompt = mx.array(list(range(1, 40)))
        for kv_bits, kv_gs in ((8, 64), (4, 64), (8, 32), (4, 32)):
            for label, f in (("off", fn), ("candidate", cand)):
                base.quantized_scaled_dot_product_attention = f
                try:
                    with engine.without(*installed):
                        base.quantized_scaled_dot_product_attention = f
                        toks = [
                            int(t)
                            for t, _ in generate_step(
                                prompt, model, max_tokens=8, kv_bits=kv_bits, kv_group_size=kv_gs, quantized_kv_start=0
                            )
                        ]
                    res = f"ok {toks}"
                except (RuntimeError, ValueError) as exc:
                    res = f"raises {exc}"
                finally:
                    base.quantized_scaled_dot_product_attention = fn
                print(
                    f"generate_step head_dim={head_dim} {heads}/{kv_heads} kv_bits={kv_bits} gs={kv_gs} {label}: {res}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
