"""The servers' own hand patches that overlap kvpatch's fixes, and the switch that turns them off.

``SERVER_FIXES`` lists, per server, each live hand patch (the function that installs or performs it),
the kvpatch fix that replaces it, and the server's own issue numbers. ``off_environ(env)`` returns a
child environment in which the server's fixes with a kvpatch counterpart do nothing: its ``PYTHONPATH``
starts with ``fixes_off/``, whose ``sitecustomize`` calls :func:`install_off_switch`. That registers an
import hook that, right after the server module that defines a fix has run, replaces the fix with a
no-op (or, for vllm-mlx's bounding, with ``kvpatch.bounding.bound_layout``). Nothing in the installed
copy is edited, child processes of the server's tests inherit the switch, and the server imports its
own modules in its own order: the fix's caller looks the name up at call time, so it gets the no-op.

vllm-mlx's metadata sweep ``MLLMBatch._sync_reshuffle_metadata`` is switched off too: kvpatch's
``churn-metadata-detach`` (and its mlx-vlm twin) evaluate the metadata that ``extend`` / ``filter`` rebuild.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SWITCH_DIR = HERE / "fixes_off"


@dataclass(frozen=True)
class ServerFix:
    server: str
    module: str  # where the fix is defined
    name: str  # attribute path of the fix in ``module`` (a function, or Class.method)
    kvpatch_id: str | None  # the kvpatch fix that replaces it (None: none yet, the fix stays on)
    issues: str  # the server's own issue numbers, as its code names them
    what: str
    replacement: str = "noop"  # "noop", or "bound_layout" (kvpatch.bounding.bound_layout)


SERVER_FIXES: tuple[ServerFix, ...] = (
    ServerFix(
        "rapid-mlx",
        "rapid_mlx._mlx_compat",
        "install_batch_slot_guard",
        "batch-logits-processors",
        "#1525",
        "wraps PromptProcessingBatch.extend: None logits-processor slots of a mixed batch become []",
    ),
    ServerFix(
        "rapid-mlx",
        "rapid_mlx.quantized_batch_cache",
        "_install_batched_mask_safe_quantized_sdpa",
        "qsdpa-gqa-batch-mask",
        "#1751",
        "wraps mlx_lm.models.base.quantized_scaled_dot_product_attention: rank-4 batch masks get a GQA axis",
    ),
    ServerFix(
        "vllm-mlx",
        "vllm_mlx.scheduler",
        "_sanitize_batch_generator_logits_processors",
        "batch-logits-processors",
        "(none named)",
        "before each BatchGenerator.next(): None slots of active_batch / _partial logits_processors become []",
    ),
    ServerFix(
        "vllm-mlx",
        "vllm_mlx.scheduler",
        "Scheduler._bound_cache_layers",
        "bounded_prompt_cache",
        "(none named)",
        "KVCache layers (and KVCache children of a CacheList) of a fresh cache become RotatingKVCache(max_kv_size)",
        replacement="bound_layout",
    ),
    ServerFix(
        "vllm-mlx",
        "vllm_mlx.mllm_batch_generator",
        "MLLMBatch._sync_reshuffle_metadata",
        "churn-metadata-detach",
        "#442",
        "evaluates offset / left_padding / lengths of every cache after MLLMBatch.filter / extend",
    ),
)

OFF_FLAG = "KVPATCH_COEXIST_SERVER_FIXES"  # "off" in a child environment made by off_environ


def switched(server: str) -> list[ServerFix]:
    """The fixes of ``server`` the switch turns off (those with a kvpatch counterpart)."""
    return [f for f in SERVER_FIXES if f.server == server and f.kvpatch_id is not None]


def off_environ(env: dict[str, str]) -> dict[str, str]:
    out = dict(env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(SWITCH_DIR), env.get("PYTHONPATH", "")) if p)
    out[OFF_FLAG] = "off"
    return out


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _neutralize(module: Any, fix: ServerFix) -> None:
    owner: Any = module
    *parents, leaf = fix.name.split(".")
    for part in parents:
        owner = getattr(owner, part)
    if fix.replacement == "bound_layout":
        from kvpatch.bounding import bound_layout

        replacement: Any = staticmethod(bound_layout) if parents else bound_layout
    elif parents and not isinstance(vars(owner).get(leaf), staticmethod):
        replacement = lambda self, *a, **k: None  # noqa: E731  (a method: keep the self argument)
    else:
        replacement = staticmethod(_noop) if parents else _noop
    setattr(owner, leaf, replacement)
    switched_off = getattr(module, "_kvpatch_coexist_switched_off", [])
    module._kvpatch_coexist_switched_off = [*switched_off, fix.name]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs the switch on a module right after its own code has run (no lock held while importing)."""

    def __init__(self, by_module: dict[str, list[ServerFix]]) -> None:
        self.by_module = by_module
        self._local = threading.local()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        fixes = self.by_module.get(name)
        if not fixes or getattr(self._local, "busy", False):
            return None
        self._local.busy = True
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
        finally:
            self._local.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, exec_module = spec.loader, spec.loader.exec_module

        def run_then_switch(module: Any) -> None:
            exec_module(module)
            for fix in fixes:
                _neutralize(module, fix)

        loader.exec_module = run_then_switch  # type: ignore[method-assign]
        return spec


def install_off_switch() -> None:
    """Called by ``fixes_off/sitecustomize.py`` in a child started with :func:`off_environ`."""
    if os.environ.get(OFF_FLAG) != "off":
        return
    by_module: dict[str, list[ServerFix]] = {}
    for fix in SERVER_FIXES:
        if fix.kvpatch_id is not None:
            by_module.setdefault(fix.module, []).append(fix)
    sys.meta_path.insert(0, _AfterImport(by_module))
