"""The suite's four tiers and where each runs: the one place that says so (tests/conftest.py marks every test with
its tier, tests/test_matrix.py picks what a bucket runs, scripts/test.sh --quick picks a tier).

``unit``         needs no mlx: tests/engine, tests/test_commits.py, tests/test_envs.py and every other test file
                 outside tests/upstream and tests/coexist that is not a runner, less :data:`INTEGRATION_HERE`.
                 Runs once, in the test environment.
``patch``        tests/upstream/test_<patch>.py, one file per patch (its regression and behaviour tests), and
                 tests/upstream/test_regressions.py (every patch's reproduction). Run in every matrix bucket: each test
                 skips itself where its patch's range is not in play (the ``requires_patch`` marker), so a patch's
                 tests run on every release of its range the matrix has, and its "not needed here" checks on the
                 releases outside it. (:data:`LM_ONLY` files skip the vlm buckets, whose mlx-lm releases have buckets
                 of their own.)
``integration``  the generic mechanics in tests/upstream that start child processes (:data:`INTEGRATION`): run once,
                 in the buckets named there (the newest mlx-lm and the newest mlx-vlm unless a file says otherwise),
                 except the tests in :data:`EVERY_RELEASE`, which run in every bucket; and the tests in
                 :data:`INTEGRATION_HERE` (a fresh virtualenv, layered releases), once, in the test environment.
``runner``       tests that run other tests in bucket processes (:data:`RUNNERS`): the matrix, the coexistence
                 buckets, upstream's own test suites.

Where a new test file goes: a patch's tests in ``tests/upstream/test_<patch_id with _>.py`` (a per-patch file needs
no entry here); a test of generic mechanics that needs a real upstream in tests/upstream, named in
:data:`INTEGRATION`; a test that needs no mlx anywhere else under tests/ (tests/engine, tests/faults, ...): unit.

This module imports neither mlx nor kvpatch's runtime: the test environment (no mlx) and the buckets both use it.
"""

from __future__ import annotations

import os
from pathlib import Path

from matrix import BY_NAME, LM_BUCKETS, VLM_BUCKETS

TESTS = Path(__file__).resolve().parent
UPSTREAM = TESTS / "upstream"

TIERS = ("unit", "patch", "integration", "runner")

#: ``KVPATCH_TIER=quick`` (scripts/test.sh --quick): unit tests here (less :data:`NOT_QUICK`), and the ``patch``
#: tier in the :data:`NEWEST` buckets only.
TIER_VAR = "KVPATCH_TIER"
#: Set by tests/test_matrix.py in the buckets it starts: there tests/upstream runs only what this module gives that
#: bucket. Unset (scripts/in_bucket.py, an environment with mlx installed) every collected test runs.
SELECT_VAR = "KVPATCH_TIER_SELECT"

#: The newest mlx-lm and mlx-vlm buckets: the installed releases a user gets today.
NEWEST: tuple[str, ...] = (LM_BUCKETS[-1].name, VLM_BUCKETS[-1].name)

#: tests/upstream files of generic mechanics (not one patch's), and the buckets each runs in. Their own skips
#: (test_e2e_lm's and test_e2e_vlm's RELEASES, test_serving's LM_RELEASE / VLM_RELEASE) name the same buckets.
INTEGRATION: dict[str, tuple[str, ...]] = {
    "test_surgery.py": NEWEST,
    "test_lifecycle.py": NEWEST,
    "test_import_threads.py": NEWEST,
    "test_bootstrap_e2e.py": NEWEST,
    "test_import_verdicts.py": NEWEST,
    "test_install_sources.py": NEWEST,
    "test_vendored.py": NEWEST,
    "test_serving.py": NEWEST,
    # the fault suite's cases that need upstream (the rest of it is tests/faults, unit tier)
    "test_store_faults.py": (LM_BUCKETS[-1].name,),
    "test_faults_process.py": (LM_BUCKETS[-1].name,),
    # oldest and newest supported mlx-lm; mlx-vlm 0.5.0 (its first batch caches) and the newest
    "test_e2e_lm.py": (LM_BUCKETS[0].name, LM_BUCKETS[-1].name),
    "test_e2e_vlm.py": (BY_NAME["vlm-0.5.0"].name, VLM_BUCKETS[-1].name),
}

#: Integration tests that say something about each release: every real target of the patches that apply there
#: installs and restores exactly. They run in every bucket.
EVERY_RELEASE: frozenset[str] = frozenset(
    {
        "test_lifecycle.py::test_before_and_after_import_agree_and_restore_is_exact",
    }
)

#: Tests outside tests/upstream that need more than this environment: a fresh virtualenv, real releases layered
#: from the cache, the upstream check. Integration tier: they run once, in the test environment, by the whole
#: command (not by the quick tier).
INTEGRATION_HERE: frozenset[str] = frozenset(
    {
        "test_autoactivate.py::test_editable_install_gets_the_bootstrap",
        "test_expiry.py::test_upstream_check_on_a_pinned_release",
        "test_pytest_plugin.py::test_required_and_applied_passes",
        "test_pytest_plugin.py::test_disabled_patch_fails_the_session",
        "test_pytest_plugin.py::test_kvpatch_off_fails_the_session_via_ini",
        "test_pytest_plugin.py::test_option_off_ignores_a_disabled_patch",
        "test_pytest_plugin.py::test_require_applied_at_server_start",
        # the bug hunt's own proof that it can fail (tests/hunt): hunts in bucket child processes, minutes
        "test_hunt_can_fail.py::test_planted_filter_bug_is_found_and_shrunk",
        "test_hunt_can_fail.py::test_lazy_drive_finds_the_offset_growth_and_not_with_kvpatch_on",
        "test_hunt_can_fail.py::test_attribution_names_the_patch_that_fixes_a_catalogue_bug",
    }
)

#: Folders under tests/ of maintainer tooling (kvpatch/maint) whose unit tests the quick tier leaves out: a
#: maintainer runs them with the tool they test; the whole command (CI) runs them.
NOT_QUICK: frozenset[str] = frozenset({"hunt"})

#: Test files (relative to tests/) that run other tests in bucket processes.
RUNNERS: frozenset[str] = frozenset({"test_matrix.py", "test_coexist.py", "test_upstream_oracle.py"})

#: Per-patch files of mlx-lm patches that exercise mlx-lm alone (no mlx-vlm class, reference or model). They run in
#: the buckets without mlx-vlm: every mlx-lm release a vlm bucket carries has a bucket of its own (checked by
#: :func:`file_runs_in_bucket`), so running them again next to mlx-vlm would repeat the same release's tests. A new
#: file runs everywhere until it is named here.
LM_ONLY: frozenset[str] = frozenset(
    {
        "test_arrays_mask_lengths.py",
        "test_batch_extend_empty.py",
        "test_batch_logits_processors.py",
        "test_batch_merge_empty.py",
        "test_batch_trim_capped.py",
        "test_chunked_trim_front.py",
        "test_gemma2_batch_mask.py",
        "test_max_kv_size_ignored.py",
        "test_offset_detach.py",
        "test_prompt_cache_exact_hit.py",
        "test_prompt_cache_key_overrun.py",
        "test_qsdpa_cuda_shapes.py",
        "test_quantized_nbytes.py",
        "test_rotating_merge_empty.py",
        "test_rotating_merge_wrapped.py",
        "test_rotating_offset_detach.py",
        "test_speculative_stale_cache.py",
    }
)

#: Tests that a kernel missing from the mlx backend (``kvpatch.testing.BACKEND_GAPS``, e.g. CUDA's quantized_matmul
#: for some shapes) may stop without failing: they compare against upstream's own quantized or TurboQuant kernels
#: (a reference or an unpatched run), which a backend may not have. tests/upstream/conftest.py turns such an error
#: into a skip for these tests only; anywhere else it fails, so a patch that routes into a missing kernel (what
#: qsdpa-cuda-shapes exists to avoid) fails its tests. Entries are file names (every test in it) or node ids
#: without parameters (``file::test``).
MAY_LACK_KERNEL: frozenset[str] = frozenset(
    {
        "test_batch_quantized_extend.py",
        "test_batch_quantized_prepare.py",
        "test_e2e_lm.py",
        "test_e2e_vlm.py",
        "test_empty_tq_rows.py",
        "test_hybrid_quant_dtype.py",
        "test_left_padding_mask.py",
        "test_offset_detach_vlm.py",
        "test_qsdpa_gqa_batch_mask.py",
        "test_quantized_nbytes.py",
        "test_qwen35_batch_positions.py",  # mlx-vlm 0.6.0-0.6.3's qwen3_5 runs a Metal kernel
        "test_speculative_stale_cache.py",
        "test_tq_batch_prepare.py",
        "test_tq_dequantize_dtype.py",
        "test_tq_filter_unprimed.py",
        "test_tq_prefix_snapshot.py",
        "test_tq_trim.py",
        "test_tq_value_codec.py",
        "test_vlm_filter_right_padding.py",
        "test_vlm_qsdpa_batch_mask.py",
    }
)


def quick() -> bool:
    """True under ``KVPATCH_TIER=quick``."""
    return os.environ.get(TIER_VAR, "").strip().lower() == "quick"


def _relative(path: Path) -> Path | None:
    try:
        return path.resolve().relative_to(TESTS)
    except ValueError:
        return None


def tier_of(nodeid: str, path: Path) -> str:
    """The tier of the test ``nodeid`` in the file ``path``."""
    rel = _relative(path)
    if rel is None:
        return "unit"
    if rel.parts[0] == "upstream":
        return "integration" if rel.name in INTEGRATION else "patch"
    if rel.parts[0] == "coexist":
        return "runner"  # run only inside the coexistence buckets, by tests/test_coexist.py
    if rel.as_posix() in RUNNERS:
        return "runner"
    return "integration" if _node(nodeid) in INTEGRATION_HERE else "unit"


def in_quick(nodeid: str, path: Path, has_mlx: bool) -> bool:
    """Whether the quick tier (``KVPATCH_TIER=quick``, outside a bucket) runs this test: the unit tests outside
    :data:`NOT_QUICK`, the matrix (which runs the patch tier in the newest buckets), and the patch tier where mlx is
    installed."""
    rel = _relative(path)
    if rel is not None and rel.parts[0] in NOT_QUICK:
        return False
    tier = tier_of(nodeid, path)
    return tier == "unit" or path.name == "test_matrix.py" or (tier == "patch" and has_mlx)


def _node(nodeid: str) -> str:
    """``file::test`` of a node id, without its folder and parameters."""
    path, _, rest = nodeid.partition("::")
    return f"{Path(path).name}::{rest.split('[')[0]}" if rest else Path(path).name


def runs_in_bucket(nodeid: str, path: Path, bucket: str) -> bool:
    """Whether the matrix runs this tests/upstream test in ``bucket`` (quick: the patch tier only)."""
    tier = tier_of(nodeid, path)
    if quick():
        return tier == "patch"
    if tier != "integration":
        return True
    return bucket in INTEGRATION[path.name] or _node(nodeid) in EVERY_RELEASE


def _repeats_an_lm_bucket(bucket: str) -> bool:
    """True for a bucket with mlx-vlm whose mlx-lm release has an mlx-lm bucket of its own."""
    own = BY_NAME[bucket]
    lm = own.version("mlx-lm")
    return own.version("mlx-vlm") is not None and any(b.version("mlx-lm") == lm for b in LM_BUCKETS)


def file_runs_in_bucket(path: Path, bucket: str) -> bool:
    """Whether any test of the file ``path`` can run in ``bucket`` (files that cannot are not even collected)."""
    tier = tier_of(path.name, path)
    if tier == "patch" and path.name in LM_ONLY and bucket in BY_NAME and _repeats_an_lm_bucket(bucket):
        return False
    if quick():
        return tier == "patch"
    if tier != "integration":
        return True
    return bucket in INTEGRATION[path.name] or any(node.startswith(f"{path.name}::") for node in EVERY_RELEASE)


def may_lack_kernel(nodeid: str) -> bool:
    node = _node(nodeid)
    return node in MAY_LACK_KERNEL or node.split("::")[0] in MAY_LACK_KERNEL
