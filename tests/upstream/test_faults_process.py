"""The fault suite's process cases with a real upstream import (the rest are in tests/faults/test_process.py): an
``import mlx_lm`` that starts a background verification under ``-W error`` / ``-X dev``, and children forked while
another thread is inside kvpatch that import upstream (hooks install patches in the child)."""

from __future__ import annotations

import os

import pytest
from faults_support import SAFE, fork_while_busy, last_json, newer_release_overlay, run_child, wait_for_lock


def test_an_import_that_starts_a_verification_says_nothing_under_strict_warnings(tmp_path):
    """A release newer than the records (every verdict-decided patch pending): ``python -W error -c "import mlx_lm"``
    and the same under ``-X dev`` start the background verification, print nothing and exit 0."""
    overlay = newer_release_overlay(tmp_path)
    started = []
    for flags in (["-W", "error"], ["-X", "dev"]):
        directory = tmp_path / f"verdicts{len(started)}"
        env = {
            "PYTHONPATH": os.pathsep.join([overlay, os.environ.get("PYTHONPATH", "")]),
            "KVPATCH_VERDICTS": str(directory),
            "KVPATCH_CACHE": str(tmp_path / "cache"),
            "KVPATCH_VERIFY": "auto",
        }
        proc = run_child([*flags, *SAFE, "-c", "import mlx_lm"], env, tmp_path, timeout=300)
        started.append(directory)
        assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", (flags, proc.stderr[-3000:])
    for directory in started:
        assert (directory / "verify.log").exists(), "no background verification was started"
        wait_for_lock(directory / "verify.lock")


#: A thread lists kvpatch's records all the time; the main thread forks children that import upstream (whose
#: post-import hooks install patches, under the engine's lock); each child must finish.
FORK = fork_while_busy(
    busy="kvpatch.records()",
    child="""
        import mlx_lm, mlx_lm.models.cache, mlx_lm.generate
        os._exit(0 if any(s.state.value == "applied" for s in kvpatch.records()) else 3)
    """,
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_children_forked_while_a_thread_is_inside_kvpatch_import_upstream(tmp_path):
    proc = run_child([*SAFE, "-c", FORK, "20"], {}, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    assert out == {"hung": 0, "failed": 0, "forked": 20}, out
