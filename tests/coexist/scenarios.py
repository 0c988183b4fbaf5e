"""Scenarios run in a fresh interpreter inside a coexistence bucket: a downstream server's own monkey
patches and kvpatch in one process, in either order, as the server would run them.

    python scenarios.py SCENARIO ORDER [OPTION]

ORDER is ``kvpatch-first`` (kvpatch active before the server patches: the normal case with the
installed ``.pth`` bootstrap) or ``server-first`` (the process starts with ``KVPATCH=off`` so that the
bootstrap stays out; the server patches, then kvpatch is switched on and imported: a late activation).
The last line printed is ``RESULT <json>``; the tests in this folder assert on it.

Only public kvpatch API is used (``kvpatch.records``, ``require_applied``, ``deactivate``,
``get_engine().suspend/resume``, ``kvpatch.testing.without``, ``kvpatch.status.build_report``), and
the downstream code is the real one from the bucket's wheel (vllm-mlx 0.6.0, Rapid-MLX 0.16.10).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

ORDERS = ("kvpatch-first", "server-first")


def activate_kvpatch() -> Any:
    """Switch kvpatch on in a process that started with ``KVPATCH=off`` (or is already on) and import it."""
    os.environ["KVPATCH"] = "on"
    import kvpatch

    kvpatch.activate()
    return kvpatch


def qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def status_of(patch_id: str) -> dict[str, Any]:
    import kvpatch

    for st in kvpatch.records():
        if st.patch.id == patch_id:
            return {"state": st.state.value, "reason": st.reason}
    raise LookupError(patch_id)


def require_applied() -> str | None:
    """None when ``kvpatch.require_applied()`` passes, else its message."""
    import kvpatch

    try:
        kvpatch.require_applied()
    except kvpatch.NotApplied as exc:
        return str(exc)
    return None


# -- tiny models ----------------------------------------------------------------------------------
def tiny_llama() -> Any:
    """A random llama (mlx-lm 0.31.3's llama defines make_cache: one KVCache per layer)."""
    from kvpatch.testing import tiny_llama as build

    return build(heads=2, kv_heads=1, vocab=128)


def batch_layout(caches: Any) -> list[str]:
    return [type(c).__name__ for c in caches]


def mixed_batch_crashes(before_step: Any = None) -> str | None:
    """A request without logits processors joins one with processors mid-prefill (what Rapid-MLX's slot
    guard and kvpatch's batch-logits-processors protect against). None when it decodes, else the error.
    ``before_step(generator)`` runs before every ``next()`` (vllm-mlx's scheduler sanitizes there)."""
    import mlx.core as mx

    generate = importlib.import_module("mlx_lm.generate")
    model = tiny_llama()

    def ban_last(tokens: Any, logits: Any) -> Any:
        return logits - 1e9 * (mx.arange(logits.shape[-1]) == tokens.reshape(-1)[-1])

    gen = generate.BatchGenerator(model, prefill_step_size=4, max_tokens=4)
    uids = list(gen.insert([list(range(10, 19))], logits_processors=[[ban_last]]))
    finished: set[int] = set()

    def step() -> None:
        if before_step is not None:
            before_step(gen)
        responses = gen.next()
        if isinstance(responses, tuple):
            responses = responses[1]
        for r in responses:
            if r.finish_reason is not None:
                finished.add(r.uid)

    try:
        step()
        uids += list(gen.insert([list(range(30, 35))]))
        for _ in range(30):
            if len(finished) == len(uids):
                break
            step()
    except TypeError as exc:
        return f"TypeError: {exc}"
    return None


# -- server patches --------------------------------------------------------------------------------
def vllm_patch() -> None:
    from vllm_mlx.utils.mamba_cache import patch_mlx_lm_for_mamba

    patch_mlx_lm_for_mamba()


def rapid_patch() -> None:
    from rapid_mlx import _mlx_compat
    from rapid_mlx.quantized_batch_cache import _install_batched_mask_safe_quantized_sdpa

    _mlx_compat.install_batch_slot_guard()
    _install_batched_mask_safe_quantized_sdpa()


SERVER_PATCHES = {"vllm-mlx": vllm_patch, "rapid-mlx": rapid_patch}

#: (owner module, attribute path, kvpatch patch id) of every attribute both a server and kvpatch replace.
SHARED = {
    "vllm-mlx": [("mlx_lm.generate", "_make_cache", "max-kv-size-ignored")],
    "rapid-mlx": [
        ("mlx_lm.generate", "PromptProcessingBatch.extend", "batch-logits-processors"),
        ("mlx_lm.models.base", "quantized_scaled_dot_product_attention", "qsdpa-gqa-batch-mask"),
    ],
}


def lookup(module: str, path: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = obj.__dict__[part] if part in vars(obj) else getattr(obj, part)
    return obj


SERVER_ATTRS: dict[str, str] = {}  # what the server put on each shared attribute, right after it patched


def prepare(server: str, order: str) -> Any:
    """Import upstream, apply the server's patches and kvpatch in ``order``; return kvpatch."""

    def server_patches() -> None:
        SERVER_PATCHES[server]()
        SERVER_ATTRS.update({f"{m}.{p}": qualified(lookup(m, p)) for m, p, _ in SHARED[server]})

    if order == "kvpatch-first":
        kvpatch = activate_kvpatch()
        importlib.import_module("mlx_lm.generate")
        importlib.import_module("mlx_lm.models.base")
        server_patches()
    else:
        importlib.import_module("mlx_lm.generate")
        importlib.import_module("mlx_lm.models.base")
        server_patches()
        kvpatch = activate_kvpatch()
    return kvpatch


# -- scenarios -------------------------------------------------------------------------------------
def scenario_make_cache(order: str) -> dict[str, Any]:
    """Item 1: vllm-mlx's patch_mlx_lm_for_mamba replaces mlx_lm.generate._make_cache without calling the
    original. Is the batch cache bounded, and what do records() / require_applied() say?"""
    prepare("vllm-mlx", order)
    generate = importlib.import_module("mlx_lm.generate")
    layout = batch_layout(generate._make_cache(tiny_llama(), [0], 16))
    return {
        "layout": layout,
        "bounded": all(name == "BatchRotatingKVCache" for name in layout),
        "current": qualified(generate._make_cache),
        "status": status_of("max-kv-size-ignored"),
        "require_applied": require_applied(),
    }


def scenario_liveness(order: str, server: str) -> dict[str, Any]:
    """Item 1, the other way round: a server wrapper on top of kvpatch's replacement that calls it (Rapid-MLX's
    slot guard and quantized-SDPA wrapper hold it in their closure; no ``__wrapped__``). The fix still runs."""
    prepare(server, order)
    result: dict[str, Any] = {
        "status": {pid: status_of(pid) for _, _, pid in SHARED[server]},
        "require_applied": require_applied(),
    }
    if server == "rapid-mlx":
        result["mixed_batch_error"] = mixed_batch_crashes()
    return result


def scenario_restore(order: str, server: str, operation: str) -> dict[str, Any]:
    """Item 2: kvpatch's restore paths (deactivate, suspend/resume, testing.without, in-process verify)
    must leave a server's wrappers where the server put them."""
    kvpatch = prepare(server, order)
    shared = SHARED[server]
    before = {f"{m}.{p}": qualified(lookup(m, p)) for m, p, _ in shared}
    ids = [pid for _, _, pid in shared]
    inside: dict[str, str] = {}
    if operation == "deactivate":
        kvpatch.deactivate()
    elif operation == "suspend":
        engine = kvpatch.get_engine()
        for pid in ids:
            engine.suspend(pid)
        inside = {f"{m}.{p}": qualified(lookup(m, p)) for m, p, _ in shared}
        for pid in ids:
            engine.resume(pid)
    elif operation == "without":
        from kvpatch.testing import without

        with without(*ids):
            inside = {f"{m}.{p}": qualified(lookup(m, p)) for m, p, _ in shared}
    elif operation == "verify":
        from kvpatch.status import build_report

        build_report(kvpatch.get_engine(), verify=True)
    else:
        raise SystemExit(f"unknown operation {operation}")
    after = {f"{m}.{p}": qualified(lookup(m, p)) for m, p, _ in shared}
    result: dict[str, Any] = {"server": dict(SERVER_ATTRS), "before": before, "inside": inside, "after": after}
    if server == "rapid-mlx":
        result["mixed_batch_error"] = mixed_batch_crashes()
    return result


def scenario_verify(order: str, server: str) -> dict[str, Any]:
    """Items 3 and 4: an in-process ``status --verify`` next to a server's patches."""
    kvpatch = prepare(server, order)
    from kvpatch.status import build_report

    report = build_report(kvpatch.get_engine(), verify=True)
    entries = {
        e["id"]: {"state": e["state"], "verify": e["verify"]["outcome"] if e["verify"] else None}
        for e in report.data["patches"]
    }
    return {"exit": report.data["check"]["exit"], "reasons": report.data["check"]["reasons"], "patches": entries}


def scenario_alias(order: str) -> dict[str, Any]:
    """Item 5: vllm_mlx.specprefill imports make_prompt_cache by name."""
    if order == "kvpatch-first":
        kvpatch = activate_kvpatch()
        specprefill = importlib.import_module("vllm_mlx.specprefill")
    else:
        specprefill = importlib.import_module("vllm_mlx.specprefill")
        kvpatch = activate_kvpatch()
    cache = importlib.import_module("mlx_lm.models.cache")
    model = tiny_llama()

    def observe() -> dict[str, Any]:
        return {
            "same": specprefill.make_prompt_cache is cache.make_prompt_cache,
            "owner_layout": batch_layout(cache.make_prompt_cache(model, 16)),
            "alias_layout": batch_layout(specprefill.make_prompt_cache(model, 16)),
        }

    active = observe()
    kvpatch.deactivate()
    restored = observe()
    return {"active": active, "deactivated": restored, "status": status_of("max-kv-size-ignored")}


# -- vllm-mlx's live hand patches (issue 29 item 7) ---------------------------------------------------
# vllm-mlx 0.6.0 patches no mlx-lm attribute on its live path (``patch_mlx_lm_for_mamba`` is dead code:
# ``ensure_mamba_support()`` only logs). Its live fixes are its own code around upstream's objects: the
# None-slot sanitizer ``Scheduler.step`` calls before every ``BatchGenerator.next()``, the bounding
# ``Scheduler._bound_cache_layers`` and the metadata sweep ``MLLMBatch._sync_reshuffle_metadata``.


def _kvpatch_in(order: str, *modules: str) -> Any:
    """Import ``modules`` (the server's) and kvpatch in ``order``; return kvpatch."""
    if order == "kvpatch-first":
        kvpatch = activate_kvpatch()
    for name in modules:
        importlib.import_module(name)
    if order == "server-first":
        kvpatch = activate_kvpatch()
    return kvpatch


def scenario_vllm_sanitizer(order: str) -> dict[str, Any]:
    """A mixed batch through mlx-lm's BatchGenerator with vllm-mlx's sanitizer before every step, as
    ``Scheduler.step`` runs it. On mlx-lm 0.31.3 it looks for ``active_batch`` / ``_partial``, which that
    BatchGenerator does not have: only kvpatch's batch-logits-processors keeps the batch alive."""
    kvpatch = _kvpatch_in(order, "vllm_mlx.scheduler", "mlx_lm.generate")
    from vllm_mlx.scheduler import _sanitize_batch_generator_logits_processors as sanitize

    generate = importlib.import_module("mlx_lm.generate")
    seen: list[bool] = []

    def before_step(gen: Any) -> None:
        seen.append(hasattr(gen, "active_batch") or hasattr(gen, "_partial"))
        sanitize(gen)

    return {
        "error": mixed_batch_crashes(before_step),
        "sanitizer_reaches_batch": any(seen),
        "has_active_batch": hasattr(generate.BatchGenerator, "active_batch"),
        "is_fixed": kvpatch.is_fixed("batch-logits-processors"),
    }


def _topology(caches: Any) -> list[Any]:
    out: list[Any] = []
    for c in caches:
        children = getattr(c, "caches", None)
        if children is not None:
            out.append([type(c).__name__, _topology(children)])
        else:
            out.append([type(c).__name__, getattr(c, "max_size", None), getattr(c, "keep", None)])
    return out


def scenario_vllm_bounding(order: str) -> dict[str, Any]:
    """vllm-mlx's ``Scheduler._bound_cache_layers`` next to ``kvpatch.bounded_prompt_cache`` / ``bound_layout``:
    the same topology for a make_cache model and for CacheList layers (its nested KVCache bounded too)."""
    kvpatch = _kvpatch_in(order, "vllm_mlx.scheduler")
    from mlx_lm.models import cache as c
    from vllm_mlx.scheduler import Scheduler

    from kvpatch.bounding import bound_layout

    model = tiny_llama()

    def nested() -> list[Any]:
        return [c.CacheList(c.KVCache(), c.RotatingKVCache(max_size=128)), c.KVCache(), c.ArraysCache(size=2)]

    return {
        "server_llama": _topology(Scheduler._bound_cache_layers(c.make_prompt_cache(model), 16)),
        "kvpatch_llama": _topology(kvpatch.bounded_prompt_cache(model, 16)),
        "server_nested": _topology(Scheduler._bound_cache_layers(nested(), 16)),
        "kvpatch_nested": _topology(bound_layout(nested(), 16)),
        "upstream_unchanged": _topology(c.make_prompt_cache(model, 16)),
    }


def _churn_edges(cycles: int, sweep: bool) -> int:
    """Edges of the lazy graph behind the batch cache's ``offset`` / ``left_padding`` after ``cycles`` of
    vllm-mlx's ``MLLMBatch.extend`` (one new row) + one decode step + ``MLLMBatch.filter`` (the oldest row)."""
    import io

    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache
    from vllm_mlx.mllm_batch_generator import MLLMBatch

    def edges(array: Any) -> int:
        buf = io.StringIO()
        mx.export_to_dot(buf, array)
        return buf.getvalue().count("->")

    def batch(uid: int, prompt_len: int) -> Any:
        cache = BatchKVCache([0])
        kv = mx.random.normal((1, 1, prompt_len, 8), key=mx.random.key(uid))
        mx.eval(cache.update_and_fetch(kv, kv))
        return MLLMBatch(
            uids=[uid], request_ids=[str(uid)], y=mx.array([1]), logprobs=[mx.array([0.0])], max_tokens=[8],
            num_tokens=[0], cache=[cache], requests=[object()],
        )  # fmt: skip

    sweep_method = vars(MLLMBatch)["_sync_reshuffle_metadata"]
    if not sweep:
        MLLMBatch._sync_reshuffle_metadata = lambda self: None  # type: ignore[method-assign]
    try:
        live = batch(0, 4)
        live.extend(batch(1, 4))
        for i in range(cycles):
            live.extend(batch(i + 2, 4))
            (cache,) = live.cache
            kv = mx.random.normal((len(live), 1, 1, 8), key=mx.random.key(1000 + i))
            mx.eval(*cache.update_and_fetch(kv, kv))
            live.filter(list(range(1, len(live))))
    finally:
        MLLMBatch._sync_reshuffle_metadata = sweep_method  # type: ignore[method-assign]
    (cache,) = live.cache
    return edges(cache.offset) + edges(cache.left_padding)


def scenario_vllm_sweep(order: str, cycles: str = "200") -> dict[str, Any]:
    """vllm-mlx's metadata sweep stays effective with kvpatch on (and what is left without it)."""
    _kvpatch_in(order, "vllm_mlx.mllm_batch_generator")
    n = int(cycles)
    return {"with_sweep": _churn_edges(n, sweep=True), "without_sweep": _churn_edges(n, sweep=False)}


def offset_graph(cache_class: Any) -> dict[int, int]:
    """Decode 60 steps on a left-padded batch cache, evaluating only what attention reads (a NoPE layer):
    edges of the lazy graph behind ``offset`` after 10 and 60 steps (flat when the offset is tied)."""
    import io

    import mlx.core as mx

    def edges(array: Any) -> int:
        buf = io.StringIO()
        mx.export_to_dot(buf, array)
        return buf.getvalue().count("->")

    cache = cache_class([2, 0])
    prompt = mx.random.normal((2, 2, 3, 16), key=mx.random.key(0))
    steps = mx.random.normal((60, 2, 2, 1, 16), key=mx.random.key(1))
    mx.eval(cache.update_and_fetch(prompt, prompt + 1))
    out = {}
    for i in range(60):
        mx.eval(cache.update_and_fetch(steps[i], steps[i] + 1))
        if i + 1 in (10, 60):
            out[i + 1] = edges(cache.offset)
    return out


def scenario_vendored(order: str, module: str = "rapid_mlx.models.mlx_vlm_vendored.cache") -> dict[str, Any]:
    """Item 6: a vendored copy of mlx-vlm's batch caches (Rapid-MLX's, or one made by the test). Run with or
    without KVPATCH_VENDORED in the environment."""
    if order == "kvpatch-first":
        kvpatch = activate_kvpatch()
        importlib.import_module("mlx_vlm.models.cache")
        vendored_module = importlib.import_module(module)
    else:
        vendored_module = importlib.import_module(module)
        importlib.import_module("mlx_vlm.models.cache")
        kvpatch = activate_kvpatch()
    from kvpatch import vendored

    copies = {f"{c.patch_id} {c.path}": c.state for c in vendored.scan(kvpatch.get_engine())}
    cls = vendored_module.BatchKVCache
    active = offset_graph(cls)
    function = vars(cls)["update_and_fetch"].__code__.co_filename  # a replacement carries the original's names
    kvpatch.deactivate()
    restored = vars(cls)["update_and_fetch"].__code__.co_filename
    after = {f"{c.patch_id} {c.path}": c.state for c in vendored.scan(kvpatch.get_engine())}
    return {"copies": copies, "edges": active, "function": function, "restored": restored, "after": after}


def main(argv: list[str]) -> int:
    name, order, *rest = argv
    if order not in ORDERS:
        raise SystemExit(f"order must be one of {ORDERS}")
    if order == "server-first" and os.environ.get("KVPATCH", "").lower() != "off":
        raise SystemExit("server-first needs KVPATCH=off in the environment (keeps the bootstrap out)")
    func = globals()[f"scenario_{name}"]
    result = func(order, *rest)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
