"""Shared fixtures. ``run_py`` runs Python code in a fresh interpreter (the way users' processes start).

Every test is marked with its tier (``unit``, ``patch``, ``integration``, ``runner``: tests/tiers.py says which
and where each runs), so ``-m`` selects tiers: ``pytest -m unit`` runs the tests that need no mlx.

``tests/upstream`` needs a real mlx-lm / mlx-vlm: where mlx is not importable (the test environment
itself, which layers upstream releases per matrix bucket) it is not collected at all, so the closing
line counts only tests that ran here; the matrix buckets that ran it are summed up separately at the end.
"""

from __future__ import annotations

import importlib.util
import os
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support import CPU_LINE, MATRIX_RESULTS, MATRIX_SELECTED, child_env, verdicts_dir

HAS_MLX = importlib.util.find_spec("mlx") is not None
#: tests/upstream runs inside matrix buckets (tests/test_matrix.py), or wherever mlx is installed.
collect_ignore = [] if HAS_MLX else ["upstream"]
if HAS_MLX:
    # Opt-in patches (behaviour changes such as max-kv-size-ignored) are tested in tests/upstream like every other
    # patch; that they stay off by default is tested in child processes, which do not inherit this
    # (support.child_env). Set here, not in tests/upstream/conftest.py: importing kvpatch builds the process's
    # engine, which reads KVPATCH_ENABLE once, and in a session over all of tests/ the modules collected before
    # tests/upstream (tests/engine, ...) import kvpatch before that folder's conftest is loaded.
    os.environ.setdefault("KVPATCH_ENABLE", "*")

import tiers  # noqa: E402  (after KVPATCH_ENABLE: it imports kvpatch, which builds the engine)


def pytest_ignore_collect(collection_path, config):
    """In a matrix bucket, files with nothing to run there are not even imported."""
    bucket = os.environ.get("KVPATCH_BUCKET")
    if bucket and os.environ.get(tiers.SELECT_VAR) and collection_path.suffix == ".py":
        if tiers.UPSTREAM in collection_path.resolve().parents and collection_path.name.startswith("test_"):
            return not tiers.file_runs_in_bucket(collection_path, bucket) or None
    return None


def pytest_collection_modifyitems(config, items):
    """Mark each test with its tier; in a matrix bucket, deselect what tests/tiers.py runs elsewhere; under
    ``KVPATCH_TIER=quick``, keep what :func:`tiers.in_quick` keeps."""
    bucket = os.environ.get("KVPATCH_BUCKET") if os.environ.get(tiers.SELECT_VAR) else None
    keep, drop = [], []
    for item in items:
        path = Path(str(item.path))
        tier = tiers.tier_of(item.nodeid, path)
        item.add_marker(tier)
        if bucket and tier in ("patch", "integration"):
            wanted = tiers.runs_in_bucket(item.nodeid, path, bucket)
        elif tiers.quick() and not bucket:
            wanted = tiers.in_quick(item.nodeid, path, HAS_MLX)
        else:
            wanted = True
        (keep if wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_finish(session):
    """Start the selected matrix buckets now, so that they run while this process runs the unit tests."""
    if session.config.option.collectonly:
        return
    chosen = [
        item for item in session.items if Path(str(item.path)).name == "test_matrix.py" and hasattr(item, "callspec")
    ]
    if chosen:
        names = [item.callspec.params["bucket"].name for item in chosen]
        chosen[0].module.start(session.config, names, session.config._tmp_path_factory.mktemp("buckets"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Matrix buckets run / failed, and what ran inside them, apart from this process's own counts."""
    lines = []
    results = config.stash.get(MATRIX_RESULTS, None)
    if results is not None:
        selected = config.stash.get(MATRIX_SELECTED, len(results))
        failed = sorted(name for name, (code, _) in results.items() if code != 0)
        totals: dict[str, int] = {}
        for _, line in results.values():
            for n, what in re.findall(r"(\d+) (\w+)", line):
                totals[what] = totals.get(what, 0) + int(n)
        inside = ", ".join(f"{n} {what}" for what, n in totals.items()) or "nothing"
        lines.append(
            f"matrix: {len(results)} of {selected} selected buckets ran, {len(results) - len(failed)} passed"
            + (f", {len(failed)} failed ({', '.join(failed)})" if failed else "")
            + f"; inside them: {inside}"
        )
    verified = config.stash.get(VERIFIED, None)
    if verified:
        lines.append(f"verdicts: {verified}")
    if not HAS_MLX:
        lines.append(
            "tests/upstream: not collected here (no mlx in this environment); it runs inside each matrix bucket "
            "(KVPATCH_MATRIX selects them; scripts/in_bucket.py runs one by hand)"
        )
    if os.environ.get(tiers.SELECT_VAR):  # a matrix bucket: its CPU time, which tests/test_matrix.py reports
        used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        lines.append(f"{CPU_LINE} {sum(u.ru_utime + u.ru_stime for u in used):.0f} s")
    if lines:
        terminalreporter.write_sep("-", "kvpatch")
        for line in lines:
            terminalreporter.write_line(line)


# kvpatch in this process (and every child, through child_env) keeps its verdicts in the session's own cache and
# starts no background verification: tests never touch the environment's verdict cache.
os.environ["KVPATCH_VERDICTS"] = verdicts_dir()
os.environ.setdefault("KVPATCH_VERIFY", "never")


@pytest.fixture
def run_py(tmp_path):
    """Run ``code`` with ``python -c`` from an empty directory; return stdout; fail with stderr."""

    def run(code: str, env: dict[str, str] | None = None, check: bool = True) -> str:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env=child_env(env),
            capture_output=True,
            text=True,
            timeout=600,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout + ("" if check else proc.stderr)

    return run


def pytest_configure(config):
    for tier, what in (
        ("unit", "needs no mlx; runs once, in the test environment"),
        ("patch", "one patch's tests (tests/upstream/test_<patch>.py): every matrix bucket"),
        ("integration", "generic mechanics against a real upstream: the buckets tests/tiers.py names"),
        ("runner", "runs other tests in bucket processes (the matrix, coexistence, upstream's own suites)"),
    ):
        config.addinivalue_line("markers", f"{tier}: {what}")
    _settle_verdicts(config)


def _settle_verdicts(config):
    """Where the installed upstream leaves patches to their verdicts (an archive, editable or git install, as the
    GPU machine's wheel files are; a release newer than checked_through), the session settles them as a user
    does: one ``python -m kvpatch verify`` into the session's verdict cache, before any test imports upstream.
    (Under xdist the controller does it once; the workers inherit the cache and the marker.)"""
    if importlib.util.find_spec("mlx") is None or os.environ.get("KVPATCH_TEST_VERIFIED"):
        return
    from kvpatch import registry
    from kvpatch.config import Config
    from kvpatch.detect import detect
    from kvpatch.gate import Action, decide

    upstream = detect()
    left = [
        p.id
        for p in registry.load().patches
        if p.distribution in upstream
        and decide(p, upstream[p.distribution], Config(enable_all=True)).action is Action.VERIFY
    ]
    os.environ["KVPATCH_TEST_VERIFIED"] = "1"
    if not left:
        return
    env = {**os.environ, "KVPATCH_ENABLE": "*", "KVPATCH_VERIFY": "never"}
    proc = subprocess.run(  # from a neutral directory: the checkout's kvpatch/ must not shadow the installed one
        [sys.executable, "-m", "kvpatch", "verify"],
        env=env,
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    config.stash[VERIFIED] = (
        f"{len(left)} patches left to verdicts here; `kvpatch verify` exit {proc.returncode}: {summary}"
    )


VERIFIED = pytest.StashKey[str]()
