"""What the cache-level hunt drives: every cache class of the installed mlx-lm / mlx-vlm that takes keys and values
(or, for ``ArraysCache``, recurrent states), found by reading the modules, and how to build each.

A class is built from its constructor's parameter names alone (a window for ``max_size``, a group size and bits
for the quantized caches, a chunk for ``chunk_size``, the rows' padding for ``left_padding``); a class with any
other required parameter is listed as not hunted, with the parameter. A batch class (``Batch<Name>``) is judged
against its single-row class ``<Name>`` of the same module. Runs inside a bucket (imports upstream).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any

from kvpatch.record import borrowed

#: The modules that define cache classes, per distribution's import name.
MODULES: dict[str, tuple[str, ...]] = {
    "mlx_lm": ("mlx_lm.models.cache",),
    "mlx_vlm": ("mlx_vlm.models.cache", "mlx_vlm.turboquant"),
}
#: Where each distribution's models take their attention and mask from.
BASE: dict[str, str] = {"mlx_lm": "mlx_lm.models.base", "mlx_vlm": "mlx_vlm.models.base"}

WINDOW = 5  # a rotating cache's window: small, so that a few tokens wrap it
#: Constructor parameters the hunt knows how to fill, by name (``left_padding`` is the rows' own).
KNOWN_PARAMETERS: dict[str, Any] = {
    "max_size": WINDOW,
    "group_size": 32,
    "bits": 4,
    "chunk_size": 4,
    "size": 1,
    "ratio": 4,
}
#: Batch operations a batch class is expected to offer when its package's BatchKVCache does (``has-operations``).
BATCH_OPERATIONS = ("prepare", "finalize", "filter", "extend", "extract", "make_mask")


@dataclass
class Target:
    """One cache class to hunt, and how to build it and its reference."""

    distribution: str  # import name: mlx_lm, mlx_vlm
    module: str
    name: str
    kind: str  # "batch", "single" or "arrays"
    single: str | None = None  # the single-row reference class (batch and arrays kinds)
    single_module: str | None = None
    arguments: dict[str, Any] = field(default_factory=dict)  # constructor keywords besides left_padding
    single_arguments: dict[str, Any] = field(default_factory=dict)
    prepare_keywords: tuple[str, ...] = ()  # the keywords its prepare() accepts (right-padded prefill)
    operations: tuple[str, ...] = ()  # the batch operations it has
    window: int | None = None
    quantized: bool = False

    @property
    def id(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def base(self) -> str:
        return BASE[self.distribution]

    def call(self, arguments: dict[str, Any], **extra: Any) -> str:
        """Keyword arguments as source text."""
        return ", ".join(f"{k}={v!r}" for k, v in {**extra, **arguments}.items())


def _parameters(cls: type) -> tuple[dict[str, Any], list[str]]:
    """The constructor keywords the hunt fills, and the required parameters it cannot."""
    try:
        signature = _init_signature(cls)
    except (TypeError, ValueError):
        return {}, ["(no signature)"]
    filled: dict[str, Any] = {}
    unknown: list[str] = []
    for name, p in signature.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or name == "left_padding":
            continue
        if name in KNOWN_PARAMETERS:
            if name != "bits" or p.default is inspect.Parameter.empty or "quant" in cls.__name__.lower():
                filled[name] = KNOWN_PARAMETERS[name]
        elif p.default is inspect.Parameter.empty:
            unknown.append(name)
    return filled, unknown


def _init_signature(cls: type) -> inspect.Signature:
    """``__init__``'s parameters without ``self`` (a class may also define ``__new__``, whose signature
    ``inspect.signature(cls)`` would give)."""
    signature = inspect.signature(getattr(cls, "__init__"))  # noqa: B009 (mypy: __init__ on a type)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def _own_classes(module: Any) -> list[type]:
    top = module.__name__.split(".", 1)[0]
    out = []
    for name, obj in vars(module).items():
        if isinstance(obj, type) and obj.__module__ == module.__name__ and not name.startswith("_"):
            if not borrowed(obj, top):
                out.append(obj)
    return out


def _find(distribution: str, name: str) -> tuple[str, type] | None:
    """The class ``name`` as the distribution's cache modules offer it (its own or one it re-exports), and the module
    to import it from."""
    for module_name in MODULES[distribution]:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        obj = getattr(module, name, None)
        if isinstance(obj, type):
            return module_name, obj
    return None


def discover(distributions: tuple[str, ...]) -> tuple[list[Target], dict[str, str]]:
    """The targets of the installed ``distributions`` (import names), and the classes not hunted with why."""
    targets: list[Target] = []
    skipped: dict[str, str] = {}
    for dist in distributions:
        batch_kv = _find(dist, "BatchKVCache")
        reference_ops = tuple(op for op in BATCH_OPERATIONS if batch_kv and hasattr(batch_kv[1], op))
        for module_name in MODULES[dist]:
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:
                skipped[module_name] = f"cannot import: {exc}"
                continue
            for cls in _own_classes(module):
                target = _target(dist, module_name, cls, reference_ops, skipped)
                if target is not None:
                    targets.append(target)
    return targets, skipped


def _target(dist: str, module_name: str, cls: type, reference_ops: tuple[str, ...], skipped: dict[str, str]) -> Any:
    name = cls.__name__
    where = f"{module_name}.{name}"
    is_arrays = hasattr(cls, "__setitem__") and hasattr(cls, "make_mask") and "Arrays" in name
    if not hasattr(cls, "update_and_fetch") and not is_arrays:
        return None  # not a cache that takes keys and values (a cache list, a prompt cache, a codec)
    arguments, unknown = _parameters(cls)
    if unknown:
        skipped[where] = f"needs constructor parameters the hunt cannot fill: {', '.join(unknown)}"
        return None
    if is_arrays:
        return Target(
            dist,
            module_name,
            name,
            "arrays",
            name,
            module_name,
            arguments,
            arguments,
            _prepare_keywords(cls),
            tuple(op for op in BATCH_OPERATIONS if hasattr(cls, op)),
        )
    if name.startswith("Batch"):
        found = _find(dist, name[len("Batch") :])
        if found is None:
            skipped[where] = f"no single-row class {name[len('Batch') :]} to judge its rows against"
            return None
        single_module, single = found
        single_arguments, unknown = _parameters(single)
        if unknown:
            skipped[where] = f"its single-row class needs parameters the hunt cannot fill: {', '.join(unknown)}"
            return None
        if "left_padding" not in _init_signature(cls).parameters:
            skipped[where] = "takes no left_padding: not a batch cache of rows"
            return None
        return Target(
            dist,
            module_name,
            name,
            "batch",
            single.__name__,
            single_module,
            arguments,
            single_arguments,
            _prepare_keywords(cls),
            tuple(op for op in reference_ops if hasattr(cls, op)),
            window=arguments.get("max_size"),
            quantized=_quantized(cls),
        )
    return Target(
        dist,
        module_name,
        name,
        "single",
        name,
        module_name,
        arguments,
        arguments,
        window=arguments.get("max_size"),
        quantized=_quantized(cls),
    )


def _quantized(cls: type) -> bool:
    return "Quant" in cls.__name__


def _prepare_keywords(cls: type) -> tuple[str, ...]:
    prepare = getattr(cls, "prepare", None)
    if prepare is None:
        return ()
    try:
        return tuple(p for p in inspect.signature(prepare).parameters if p in ("lengths", "right_padding"))
    except (TypeError, ValueError):
        return ()
