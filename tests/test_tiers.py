"""tests/tiers.py names files, tests and buckets: each must exist, or a renamed file would silently change tier."""

from __future__ import annotations

import ast
from pathlib import Path

import tiers
from matrix import BY_NAME, LM_BUCKETS, VLM_BUCKETS

TESTS = Path(__file__).resolve().parent


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def _exists(node: str, folder: Path) -> bool:
    name, _, test = node.partition("::")
    matches = list(folder.rglob(name))
    return len(matches) == 1 and (not test or test in _tests_in(matches[0]))


def test_named_files_and_tests_exist():
    upstream = [*tiers.INTEGRATION, *tiers.EVERY_RELEASE, *tiers.MAY_LACK_KERNEL, *tiers.LM_ONLY]
    assert [node for node in upstream if not _exists(node, tiers.UPSTREAM)] == []
    assert [node for node in tiers.INTEGRATION_HERE if not _exists(node, TESTS)] == []
    assert [name for name in tiers.RUNNERS if not (TESTS / name).is_file()] == []
    assert [name for name in tiers.NOT_QUICK if not (TESTS / name).is_dir()] == []


def test_named_buckets_exist_and_every_release_tests_are_integration():
    assert {name for where in tiers.INTEGRATION.values() for name in where} <= set(BY_NAME)
    assert {node.split("::")[0] for node in tiers.EVERY_RELEASE} <= set(tiers.INTEGRATION)


def test_tiers_of_paths():
    assert tiers.tier_of("x", TESTS / "engine" / "test_gate.py") == "unit"
    assert tiers.tier_of("x", TESTS / "test_matrix.py") == "runner"
    assert tiers.tier_of("x", tiers.UPSTREAM / "test_offset_detach.py") == "patch"
    assert tiers.tier_of("x", tiers.UPSTREAM / "test_surgery.py") == "integration"
    node = "tests/engine/test_expiry.py::test_upstream_check_on_a_pinned_release"
    assert tiers.tier_of(node, TESTS / "engine" / "test_expiry.py") == "integration"


def test_integration_runs_once_and_restore_checks_everywhere(monkeypatch):
    monkeypatch.delenv(tiers.TIER_VAR, raising=False)
    surgery = tiers.UPSTREAM / "test_surgery.py"
    lifecycle = tiers.UPSTREAM / "test_lifecycle.py"
    restore = "tests/upstream/test_lifecycle.py::test_before_and_after_import_agree_and_restore_is_exact"
    assert tiers.runs_in_bucket("tests/upstream/test_surgery.py::test_x", surgery, tiers.NEWEST[0])
    assert not tiers.runs_in_bucket("tests/upstream/test_surgery.py::test_x", surgery, "lm-0.28.4")
    assert not tiers.file_runs_in_bucket(surgery, "lm-0.28.4")
    assert tiers.runs_in_bucket(restore, lifecycle, "lm-0.28.4")
    assert tiers.file_runs_in_bucket(lifecycle, "lm-0.28.4")
    assert tiers.runs_in_bucket("x::test_y", tiers.UPSTREAM / "test_offset_detach.py", "lm-0.28.4")
    monkeypatch.setenv(tiers.TIER_VAR, "quick")
    assert not tiers.runs_in_bucket(restore, lifecycle, tiers.NEWEST[0])
    assert tiers.runs_in_bucket("x::test_y", tiers.UPSTREAM / "test_offset_detach.py", tiers.NEWEST[0])


def test_quick_tier_leaves_out_maintainer_tooling_tests():
    parts = TESTS / "hunt" / "test_hunt_parts.py"
    assert tiers.tier_of("x", parts) == "unit" and not tiers.in_quick("x", parts, has_mlx=True)
    assert tiers.in_quick("x", TESTS / "engine" / "test_gate.py", has_mlx=False)
    assert tiers.in_quick("x::test_y", TESTS / "test_matrix.py", has_mlx=False)
    offset = tiers.UPSTREAM / "test_offset_detach.py"
    assert tiers.in_quick("x", offset, has_mlx=True) and not tiers.in_quick("x", offset, has_mlx=False)


def test_lm_only_files_run_on_every_mlx_lm_release_once():
    offset = tiers.UPSTREAM / "test_offset_detach.py"
    assert tiers.file_runs_in_bucket(offset, "lm-0.31.3")
    assert not tiers.file_runs_in_bucket(offset, "vlm-0.6.16")  # mlx-lm 0.31.3 again
    assert tiers.file_runs_in_bucket(tiers.UPSTREAM / "test_lm_filter_right_padding.py", "vlm-0.6.16")
    for name in tiers.LM_ONLY:
        text = (tiers.UPSTREAM / name).read_text(encoding="utf-8")
        assert "mlx_vlm" not in text and "mlx-vlm" not in text, name
    lm_releases = {b.version("mlx-lm") for b in LM_BUCKETS}
    assert {b.version("mlx-lm") for b in VLM_BUCKETS} <= lm_releases


def test_backend_gap_skips_are_named():
    assert tiers.may_lack_kernel("tests/upstream/test_tq_trim.py::test_a[x]")
    assert not tiers.may_lack_kernel("tests/upstream/test_qsdpa_cuda_shapes.py::test_a")
