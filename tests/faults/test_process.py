"""kvpatch in a process that forks, runs under ``-W error`` or ``-X dev``, has a full disk, or loses kvpatch's files
while it runs. Children of the real installed kvpatch; no upstream needed (the cases with a real upstream import are
in tests/upstream/test_faults_process.py)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import textwrap
from pathlib import Path

import pytest
from faults_support import REQUEST, SAFE, fork_while_busy, last_json, run_child, site_packages, wait_for_lock

# -- a verification pending under -W error and -X dev ----------------------------------------------------------


@pytest.mark.parametrize("flags", [["-W", "error"], ["-X", "dev"], ["-X", "dev", "-W", "error"]], ids=" ".join)
def test_starting_a_background_verification_says_nothing_under_strict_warnings(tmp_path, flags):
    """The verifier is started detached (its handle reaped, no child left to the process): no ``ResourceWarning:
    subprocess N is still running`` at exit, so ``-W error`` prints no "Exception ignored"."""
    directory = tmp_path / "verdicts"
    env = {"KVPATCH_VERDICTS": str(directory), "KVPATCH_VERIFY": "auto"}
    proc = run_child([*flags, *SAFE, "-c", REQUEST], env, tmp_path, timeout=120)
    wait_for_lock(directory / "verify.lock")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    out = last_json(proc.stdout)
    assert "verifying in the background" in out["said"], out
    assert out["child"] is False, "the verifier is left as a child of the user's process"
    assert "kvpatch verify" in (directory / "verify.log").read_text()  # and it ran


def test_a_pytest_session_under_W_error_with_a_verification_pending_passes(tmp_path):
    (tmp_path / "test_pending.py").write_text(
        "def test_pending():\n"
        "    from kvpatch import verifier\n"
        "    assert 'verifying in the background' in verifier.request_verification(['k'])\n"
    )
    directory = tmp_path / "verdicts"
    env = {"KVPATCH_VERDICTS": str(directory), "KVPATCH_VERIFY": "auto"}
    # only kvpatch's plugin: another installed plugin's own warnings (pytest-benchmark's under xdist) are not kvpatch's
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    args = ["-m", "pytest", "-W", "error", "-q", "-p", "no:cacheprovider", "-p", "kvpatch_pytest"]
    proc = run_child([*SAFE, *args], env, tmp_path)
    wait_for_lock(directory / "verify.lock")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "Unraisable" not in proc.stdout + proc.stderr, proc.stdout[-3000:]


# -- a full disk --------------------------------------------------------------------------------------------------

#: A sitecustomize for every process of the test (the verifier too): each rename into place fails with ENOSPC.
FULL_DISK = "import errno, os\ndef _full(*a, **k):\n    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\nos.replace = _full\n"


def test_a_full_disk_does_not_start_a_verification_in_every_process(tmp_path):
    """A verification whose attempt (its one-hour back-off) cannot be stored would be started again by the next
    process, and the next: none is started while nothing can be stored, and the note says why."""
    full = tmp_path / "full"
    full.mkdir()
    (full / "sitecustomize.py").write_text(FULL_DISK)
    directory = tmp_path / "verdicts"
    env = {
        "KVPATCH_VERDICTS": str(directory),
        "KVPATCH_VERIFY": "auto",
        "PYTHONPATH": os.pathsep.join([str(full), os.environ.get("PYTHONPATH", "")]),
    }
    said = []
    for _ in range(3):
        proc = run_child([*SAFE, "-c", REQUEST], env, tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        said.append(last_json(proc.stdout)["said"])
        wait_for_lock(directory / "verify.lock")
    started = [s for s in said if "verifying in the background" in s]
    assert len(started) <= 1, said
    assert all("none could be stored" in s or "has not settled it" in s for s in said if s not in started), said


# -- fork ---------------------------------------------------------------------------------------------------------

#: A thread in kvpatch all the time (the engine's lock, the warning path's, the import hooks'); the children use
#: each of them.
FORK = fork_while_busy(
    setup="from kvpatch import _site, _warn\nhooks = _site.hooks()\n",
    busy="""
        kvpatch.records()
        _warn.emit("busy", key="busy")
        hooks.register_post_import_hook(lambda module: None, "json")
    """,
    child="""
        kvpatch.records()
        _warn.emit("child", key="child")
        hooks.register_post_import_hook(lambda module: None, "json")
        os._exit(0)
    """,
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_fork_while_another_thread_is_inside_kvpatch_never_hangs_the_child(tmp_path):
    """The lock another thread held at the fork is held forever in the child: kvpatch's locks are made anew in a
    child (``os.register_at_fork``), as ``logging``'s are."""
    proc = run_child([*SAFE, "-c", FORK, "20"], {}, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    assert out == {"hung": 0, "failed": 0, "forked": 20}, out


# -- kvpatch's files gone while the process runs -------------------------------------------------------------------


@pytest.fixture
def kvpatch_copy(tmp_path) -> Path:
    """The installed kvpatch copied beside its bootstrap (a site directory of its own the test may delete from)."""
    installed = Path(site_packages()) / "kvpatch"
    if not (installed / "patches").is_dir():
        pytest.skip("kvpatch is not installed")
    copy = tmp_path / "site"
    shutil.copytree(installed, copy / "kvpatch", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("_kvpatch_boot.py", "_kvpatch_hooks.py"):
        shutil.copy2(installed.parent / name, copy / name)
    return copy


UNINSTALLED = textwrap.dedent(
    """
    import json, shutil, sys, warnings
    warnings.simplefilter("ignore")
    import kvpatch
    known = len(kvpatch.get_engine().patches)
    pid = kvpatch.records()[-1].patch.id

    def calls():
        out = {"records": len(kvpatch.records())}
        for name, call in [("is_fixed", lambda: kvpatch.is_fixed(pid)), ("require", lambda: kvpatch.require(pid)),
                           ("require_applied", kvpatch.require_applied),
                           ("unknown", lambda: kvpatch.is_fixed("no-such"))]:
            try:
                out[name] = repr(call())
            except Exception as exc:
                out[name] = type(exc).__name__
        return out

    before = calls()
    shutil.rmtree(sys.argv[1])  # pip uninstall kvpatch, from another shell
    print("@@" + json.dumps({"known": known, "before": before, "after": calls()}))
    """
)


def test_kvpatch_uninstalled_while_the_process_runs(tmp_path, kvpatch_copy):
    """Every patch keeps its status (decided when kvpatch started), and the assertions raise nothing but what their
    documentation says (``UnknownPatch`` for an unknown id)."""
    env = {"PYTHONPATH": os.pathsep.join([str(kvpatch_copy), os.environ.get("PYTHONPATH", "")])}
    proc = run_child([*SAFE, "-c", UNINSTALLED, str(kvpatch_copy / "kvpatch")], env, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    assert out["after"]["records"] == out["known"], out
    assert out["after"] == out["before"], out  # each call returns, or raises what it documents, as before
    assert out["after"]["unknown"] == "UnknownPatch", out


# -- a stale bootstrap ---------------------------------------------------------------------------------------------

BOOT_SITE = (
    Path(importlib.util.find_spec("_kvpatch_boot").origin).parent if importlib.util.find_spec("_kvpatch_boot") else None
)

#: kvpatch.pth's line as site runs it (twice: some virtualenvs list their site-packages twice), then an mlx import.
STALE_PTH = textwrap.dedent(
    """
    import os, sys
    sitedir = sys.argv[1]
    line = [x for x in open(os.path.join(sitedir, "kvpatch.pth")) if x.startswith("import ")][0]
    exec(line)
    exec(line)
    import mlx_lm
    print("@@{}")
    """
)


@pytest.mark.skipif(BOOT_SITE is None, reason="kvpatch is not installed (no .pth bootstrap)")
@pytest.mark.parametrize("value", ["off", "on", None])
def test_a_stale_pth_without_its_bootstrap_says_nothing(tmp_path, value):
    """kvpatch.pth left behind without _kvpatch_boot.py (kvpatch removed): nothing to start, nothing said, in
    every process, whatever ``KVPATCH`` says."""
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy2(BOOT_SITE / "kvpatch.pth", site / "kvpatch.pth")
    (tmp_path / "stand_in" / "mlx_lm").mkdir(parents=True)
    (tmp_path / "stand_in" / "mlx_lm" / "__init__.py").write_text("")
    env = {"KVPATCH": value, "PYTHONPATH": str(tmp_path / "stand_in")}
    proc = run_child(["-S", "-c", STALE_PTH, str(site)], env, tmp_path, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_status_without_the_bootstrap_exits_70_with_one_line(tmp_path, kvpatch_copy):
    """A kvpatch whose _kvpatch_boot.py is gone: ``status --check`` says "reinstall" and exits 70 (kvpatch's own
    failure), not 1 ("attention needed") with a traceback."""
    (kvpatch_copy / "_kvpatch_boot.py").unlink()
    env = {"PYTHONPATH": os.pathsep.join([str(kvpatch_copy), os.environ.get("PYTHONPATH", "")])}
    proc = run_child([*SAFE, "-m", "kvpatch", "status", "--check"], env, tmp_path, timeout=300)
    assert proc.returncode == 70, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("kvpatch: ") and "(exit 70)" in ln]
    assert len(said) == 1 and "reinstall kvpatch" in said[0], proc.stderr
