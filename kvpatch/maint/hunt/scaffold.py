"""The helpers a hunt reproduction carries: plain code over mlx and one upstream, nothing of kvpatch.

This module is text, never imported: :mod:`kvpatch.maint.hunt.tape` executes its functions in a namespace that
holds the upstream names the hunted cache needs (the import line marked ``hunt: upstream`` stands for them), and
:mod:`kvpatch.maint.hunt.repro` copies the functions a finding uses into its reproduction, so the hunt and the
reproduction run the same code. Everything here reads as it would in an upstream bug report, and is short: a
reproduction carries it.
"""

# ruff: noqa: F821, E501, B905
# (the upstream names come from the namespace the hunt executes this in, or from the reproduction's imports)

import mlx.core as mx

# hunt: upstream


def data(seed, rows, n, dims=(32, 32), dtype=mx.float32):
    """Random queries (4 heads), keys and values (2 heads: grouped-query attention) for rows x n tokens."""
    keys = mx.random.split(mx.random.key(seed), 3)
    return tuple(
        mx.random.normal((rows, h, n, d), key=r).astype(dtype)
        for r, h, d in zip(keys, (4, 2, 2), (dims[0], dims[0], dims[1]))
    )


def attend(cache, q, k, v, masked=True):
    """One attention layer's use of a cache, as the models do it: the mask, update_and_fetch, attention."""
    mask = mask_for(cache, q.shape[2]) if masked else None
    keys, values = cache.update_and_fetch(k, v)
    return scaled_dot_product_attention(q, keys, values, cache=cache, scale=q.shape[-1] ** -0.5, mask=mask), keys


def alone(cache, q, k, v):
    """The reference: one row's tokens through a single-row cache of its own, one token at a time (no mask)."""
    return mx.concatenate(
        [attend(cache, *(x[:, :, t : t + 1] for x in (q, k, v)), False)[0] for t in range(q.shape[2])], axis=2
    )


def step(cache, rows, seed, n, left=None, right=None, dims=(32, 32), dtype=mx.float32):
    """n tokens for every row (row i: left[i] padding first, right[i] last), through the batch and each row alone."""
    left, right = left or [0] * len(rows), right or [0] * len(rows)
    q, k, v = data(seed, len(rows), n, dims, dtype)
    # each row's own tokens, taken before the batch call (upstream's quantized attention scales its queries in place)
    real = [(i, row, slice(a, n - b)) for i, (row, a, b) in enumerate(zip(rows, left, right)) if n - b > a]
    own = [(i, s, row, [x[i : i + 1, :, s] for x in (q, k, v)]) for i, row, s in real]
    out, keys = attend(cache, q, k, v)
    return [(out[i : i + 1, :, s], alone(row, *xs)) for i, s, row, xs in own], keys, k


def restore(cache, fresh):
    """A fresh cache of the same class given the cache's state (and meta_state), as a prefix-cache restore does."""
    fresh.state = cache.state
    if hasattr(type(cache), "meta_state"):
        fresh.meta_state = cache.meta_state
    return fresh


def snapshot(cache, fresh):
    """The cache's prefix-cache snapshot restored into a fresh cache (mlx-vlm's prefix-cache protocol)."""
    fresh.prefix_cache_restore(cache.prefix_cache_snapshot())
    return fresh


def recur(cache, seed, n, rows, width=8):
    """A recurrent (SSM-style) layer's use of an ArraysCache for n tokens: positions its mask leaves out keep the state."""
    x = mx.random.normal((rows, n, width), key=mx.random.key(seed))
    mask = cache.make_mask(n)
    state = cache[0] if cache[0] is not None else mx.zeros((rows, width))
    for t in range(n):
        state = state * 0.5 + x[:, t] if mask is None else mx.where(mask[:, t : t + 1], state * 0.5 + x[:, t], state)
    cache[0] = state
    if hasattr(cache, "advance"):
        cache.advance(n)
    return state, x


def recur_alone(cache, x):
    """The reference: one row's real inputs through an ArraysCache of its own, one token at a time."""
    for t in range(x.shape[1]):
        cache[0] = (cache[0] if cache[0] is not None else mx.zeros((1, x.shape[2]))) * 0.5 + x[:, t]
    return cache[0]


def edges(array):
    """Edges of the unevaluated graph behind an array (what stays pending until something evaluates it)."""
    import io

    buf = io.StringIO()
    mx.export_to_dot(buf, array)
    return buf.getvalue().count("->")
