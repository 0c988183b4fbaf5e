"""Downstream servers' own tests, kvpatch on and off: identical outcomes, test by test (issue 11).

The test files come from the server's sdist (``downstream.sdist_tree``: cached under the kvpatch cache
dir, never committed). ``KVPATCH_COEXIST=1`` runs the files aimed at the attributes both patch
(``downstream.DEFAULT_FILES``); ``KVPATCH_COEXIST=full`` every test file that touches mlx-lm / mlx-vlm
caches, the batch generator or quantized attention (40 files of vllm-mlx 0.6.0, 111 of Rapid-MLX 0.16.10).
Item 7 lives here: vllm-mlx's ``test_make_prompt_cache_ignores_the_bound_for_make_cache_models`` probes
whether upstream still ignores ``max_kv_size``; a behaviour-changing patch that is on by default makes
the server conclude upstream changed.
"""

from __future__ import annotations

import os

import pytest
from coexist_support import installed, needs
from downstream import DEFAULT_FILES, overlapping_files, run_tests, sdist_tree, tally
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
