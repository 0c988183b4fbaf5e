"""Downstream servers' own tests, kvpatch on and off: identical outcomes, test by test (issue 11).

The test files come from the server's sdist (``downstream.sdist_tree``: cached under the kvpatch cache
dir, never committed). ``KVPATCH_COEXIST=1`` runs the files aimed at the attributes both patch
(``downstream.DEFAULT_FILES``); ``KVPATCH_COEXIST=full`` every test file that touches mlx-lm / mlx-vlm
caches, the batch generator or quantized attention (40 files of vllm-mlx 0.6.0, 111 of Rapid-MLX 0.16.10).
Item 7 lives here: vllm-mlx's ``test_make_prompt_cache_ignores_the_bound_for_make_cache_models`` probes
whether upstream still ignores ``max_kv_size``; a behaviour-changing patch that is on by default makes
the server conclude upstream changed.

Issue 29 ("servers delete their hand patches"): the test files that exercise each server's own fixes
(``FIX_FILES``) run with the server's fixes on and kvpatch off, then with the fixes that kvpatch replaces
switched off (``server_fixes.off_environ``) and kvpatch on. The outcomes must be the same except in the
tests that assert the removed code itself (``ASSERTS_THE_FIX``, each with why): those must pass with the
fixes on and fail with them off, which also proves the switch reached the server (and its child processes).
About a minute per server on 2 cores; runs at every KVPATCH_COEXIST level.
"""

from __future__ import annotations

import os

import pytest
from coexist_support import installed, needs
from downstream import DEFAULT_FILES, overlapping_files, run_tests, sdist_tree, tally
from server_fixes import off_environ, switched
from support import child_env

SERVERS = ("vllm-mlx", "rapid-mlx")


def _files(server: str, tree) -> list[str]:
    if os.environ.get("KVPATCH_COEXIST", "").strip().lower() == "full":
        return overlapping_files(tree)
    return DEFAULT_FILES[server]


@pytest.mark.slow
@pytest.mark.parametrize("server", SERVERS)
def test_server_suite_identical_with_kvpatch_on_and_off(server):
    needs(server)
    tree = sdist_tree(server, installed(server))
    files = _files(server, tree)
    on = run_tests(tree, files, child_env())
    off = run_tests(tree, files, child_env({"KVPATCH": "off"}))
    print(f"{server} {installed(server)}: {len(files)} files; kvpatch on: {tally(on)}; off: {tally(off)}")
    assert on, f"no test ran from {files}"
    differ = {t: (on.get(t), off.get(t)) for t in sorted(set(on) | set(off)) if on.get(t) != off.get(t)}
    assert not differ, f"outcomes differ (on, off): {differ}"


def test_vllm_mlx_probe_of_upstream_max_kv_size_passes_with_kvpatch_on():
    """Item 7, alone so that it runs whatever KVPATCH_COEXIST selects."""
    needs("vllm-mlx")
    tree = sdist_tree("vllm-mlx", installed("vllm-mlx"))
    test = (
        "tests/test_scheduler_max_kv_size.py::TestBoundedCacheTopology::"
        "test_make_prompt_cache_ignores_the_bound_for_make_cache_models"
    )
    outcomes = run_tests(tree, [test], child_env())
    assert list(outcomes.values()) == ["passed"], outcomes


#: The server test files that exercise the hand patches kvpatch replaces (server_fixes.SERVER_FIXES).
FIX_FILES = {
    "vllm-mlx": [
        "tests/test_batching.py",  # Scheduler.step's None-slot sanitizer
        "tests/test_scheduler_max_kv_size.py",  # Scheduler._bound_cache_layers and its topology check
        "tests/test_max_kv_size.py",
        "tests/test_batch_reshuffle_metadata.py",  # the metadata sweep (churn-metadata-detach in its place)
    ],
    "rapid-mlx": [
        "tests/test_mixed_batch_logits_processor_slots.py",  # the #1525 batch slot guard
        "tests/test_quantized_batch_cache.py",  # the batched-mask quantized SDPA wrapper
        "tests/test_affine8_attention.py",
    ],
}

#: Tests whose subject is the server's own fix (its wiring, its marker, its effect on a stub): with the fix
#: switched off they fail whatever kvpatch does. Every other outcome must be the same.
ASSERTS_THE_FIX = {
    "vllm-mlx": {
        "tests.test_batching.TestSchedulerBasic::test_step_normalizes_stale_none_logits_processor_slots": (
            "runs Scheduler.step on a stub BatchGenerator whose active_batch holds None slots and asserts the "
            "sanitizer rewrote them; mlx-lm 0.31.3's BatchGenerator has no active_batch, so on the pinned release "
            "the sanitizer never reaches a real batch (kvpatch's batch-logits-processors fixes the real one)"
        ),
        **{
            f"tests.test_batch_reshuffle_metadata.TestSyncReshuffleMetadata::{name}": (
                "calls MLLMBatch._sync_reshuffle_metadata() itself and asserts what it passed to mx.eval: the removed "
                "sweep's own unit test (the public extend / filter tests of the same file pass with "
                "churn-metadata-detach in its place)"
            )
            for name in (
                "test_collects_batch_kv_cache_metadata",
                "test_recurses_into_cache_list_children",
                "test_none_cache_slots_are_skipped",
            )
        },
    },
    "rapid-mlx": {
        "tests.test_mixed_batch_logits_processor_slots::test_scheduler_import_installs_the_guard": (
            "asserts that importing rapid_mlx.scheduler sets the guard's marker (_rapid_mlx_slot_guard) on "
            "PromptProcessingBatch, in a child process: the wiring of the removed guard"
        ),
        "tests.test_quantized_batch_cache::test_install_wires_the_mask_patch": (
            "asserts that install_quantized_batch_cache() installs Rapid's own wrapper over "
            "quantized_scaled_dot_product_attention: the wiring of the removed wrapper"
        ),
    },
}


@pytest.mark.parametrize("server", SERVERS)
def test_server_tests_pass_with_kvpatch_instead_of_the_server_fixes(server):
    needs(server)
    assert switched(server), f"no fix of {server} is switched off"
    tree = sdist_tree(server, installed(server))
    files = FIX_FILES[server]
    own = run_tests(tree, files, child_env({"KVPATCH": "off"}))
    # KVPATCH_DISABLE reaches this run only (kvpatch with a patch taken out must show the difference)
    removed = {k: os.environ[k] for k in ("KVPATCH_DISABLE",) if k in os.environ}
    ours = run_tests(tree, files, off_environ(child_env(removed)))
    print(f"{server}: server fixes on, kvpatch off: {tally(own)}; server fixes off, kvpatch on: {tally(ours)}")
    assert own and set(own) == set(ours), "the two runs collected different tests"
    differ = {t: (own[t], ours[t]) for t in sorted(own) if own[t] != ours[t]}
    expected = ASSERTS_THE_FIX[server]
    assert set(differ) == set(expected), f"outcomes differ (fixes on, fixes off + kvpatch): {differ}"
    assert all(pair == ("passed", "failed") for pair in differ.values()), differ
