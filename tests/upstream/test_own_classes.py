"""No mlx-vlm patch changes a class that ``mlx_vlm.models.cache`` re-exports from mlx-lm (mlx-vlm 0.6.3 and older):
for a patch of mlx-vlm's own copies (``Patch.own_classes_only``) the engine leaves such a target alone, and mlx-lm's
twin patch covers the class."""

from __future__ import annotations

import importlib

import pytest

import kvpatch
from kvpatch import surgery
from kvpatch.record import borrowed


def _owner(module: str, qualname: str):
    owner = importlib.import_module(module)
    for part in qualname.split(".")[:-1]:
        owner = getattr(owner, part)
    return owner


def test_no_mlx_vlm_patch_on_a_class_of_mlx_lm():
    pytest.importorskip("mlx_vlm")
    records = [r for r in kvpatch.records() if r.patch.distribution == "mlx-vlm"]
    for r in records:
        for module in r.patch.modules:
            try:
                importlib.import_module(module)
            except Exception:
                pass  # a module this release lacks, or cannot import on this backend
    borrowed_seen = []
    for r in kvpatch.records():
        patch = r.patch
        if patch.distribution != "mlx-vlm":
            continue
        for target in patch.targets:
            try:
                owner = _owner(target.module, target.qualname)
            except Exception:
                continue  # a target this release lacks, or a module this backend cannot import
            if not borrowed(owner, patch.import_name):
                continue
            borrowed_seen.append(target.path)
            assert target not in r.installed, f"{patch.id} installed on mlx-lm's class: {target.path}"
            chain = surgery.reachable(vars(owner).get(target.attribute), closures=False)
            assert all(surgery.mark_of(node) != patch.id for node in chain), (patch.id, target.path)
    if not borrowed_seen:
        pytest.skip("mlx_vlm.models.cache has no class of mlx-lm's here (mlx-vlm 0.6.4+)")
