"""Where the patch units live (CONTRIBUTING.md, "Layout"): inside the package, one folder per distribution,
one file name per patch id; nothing of the repository is importable as a top-level ``patches``."""

from __future__ import annotations

import pkgutil

from support import REPO

import kvpatch.patches
from kvpatch import registry
from kvpatch.registry import module_for


def test_every_unit_lives_where_its_id_and_distribution_say():
    reg = registry.load()
    assert not reg.broken, reg.broken
    misplaced = {p.id: p.module for p in reg.patches if p.module != module_for(p.id, p.distribution)}
    assert not misplaced, f"move each unit to the module its id names: {misplaced}"


def test_the_naming_rule_drops_only_the_folder_s_distribution():
    assert module_for("offset-detach-vlm", "mlx-vlm") == "kvpatch.patches.mlx_vlm.offset_detach"
    assert module_for("vlm-arrays-advance-detach", "mlx-vlm") == "kvpatch.patches.mlx_vlm.arrays_advance_detach"
    assert module_for("lm-filter-right-padding", "mlx-lm") == "kvpatch.patches.mlx_lm.filter_right_padding"
    assert module_for("tq-trim", "mlx-vlm") == "kvpatch.patches.mlx_vlm.tq_trim"
    assert module_for("vlm-x", "mlx-lm") == "kvpatch.patches.mlx_lm.vlm_x"


def test_the_package_holds_distribution_folders_and_shared_helpers_only():
    """Beside the two distribution folders only underscore modules (shared fix helpers) live in kvpatch.patches,
    and no repository folder outside the package holds units."""
    top = {(m.name, m.ispkg) for m in pkgutil.iter_modules(kvpatch.patches.__path__)}
    assert {name for name, ispkg in top if ispkg} == {"mlx_lm", "mlx_vlm"}
    assert all(name[0] == "_" for name, ispkg in top if not ispkg), top
    assert not (REPO / "patches").exists()
