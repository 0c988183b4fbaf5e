"""Trust ends at the owner: kvpatch's state directories, as another user or a planted file would leave them.

Each test starts the real installed kvpatch in a child process whose verdicts live in a directory the
test prepares (``KVPATCH_VERDICTS``), then checks what kvpatch read, wrote or ran.
"""

from __future__ import annotations

import fcntl
import os
import stat
import textwrap
import time
from pathlib import Path

import pytest
from faults_support import SAFE, last_json, run_child

#: A child that reads one verdict (``sys.argv[1]``: its key) and reports it with its peak memory.
LOOKUP = textwrap.dedent(
    """
    import json, resource, sys
    from kvpatch import verdicts
    found = verdicts.lookup(sys.argv[1])
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print("@@" + json.dumps({"found": None if found is None else found.outcome, "rss_mb": rss_kb // 1024}))
    """
)


def _plant_verdict(directory: Path, key: str, version: str | None = None) -> None:
    """A well-formed "bug absent upstream" verdict for ``key`` (what an attacker who computed the key writes)."""
    import json

    from kvpatch import __version__, verdicts

    entry = {"patch": "demo", "outcome": verdicts.Outcome.ABSENT, "detail": "", "at": 1.0, "by": "planted"}
    entry["kvpatch"] = version or __version__
    data = {"schema": verdicts.SCHEMA, "verdicts": {key: entry}, "attempts": {}, "fingerprints": {}}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / verdicts.FILE).write_text(json.dumps(data))


def _lookup(tmp_path: Path, directory: Path, key: str = "k") -> tuple[dict, str]:
    proc = run_child([*SAFE, "-c", LOOKUP, key], {"KVPATCH_VERDICTS": str(directory)}, tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return last_json(proc.stdout), proc.stderr


@pytest.mark.parametrize("mode", [0o755, 0o700, 0o1777])
def test_a_verdict_in_a_directory_only_we_can_change_is_read(tmp_path, mode):
    """The control (the planted file is well-formed, so the refusals below are the trust check's doing), and a
    sticky world-writable directory (``/tmp``), where no one can replace another user's file."""
    directory = tmp_path / "verdicts"
    _plant_verdict(directory, "k")
    directory.chmod(mode)
    out, err = _lookup(tmp_path, directory)
    assert out["found"] == "bug absent upstream", (out, err)


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_directory_others_can_write_is_refused_with_one_warning(tmp_path, mode):
    directory = tmp_path / "verdicts"
    _plant_verdict(directory, "k")
    directory.chmod(mode)
    out, err = _lookup(tmp_path, directory)
    assert out["found"] is None, f"a verdict from a directory others can write was used: {out}"
    lines = [ln for ln in err.splitlines() if str(directory) in ln]
    assert len(lines) == 1 and "writable by others" in lines[0], err


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another user needs root")
def test_a_directory_owned_by_another_user_is_refused(tmp_path):
    directory = tmp_path / "verdicts"
    _plant_verdict(directory, "k")
    os.chown(directory, 12345, 12345)
    out, err = _lookup(tmp_path, directory)
    assert out["found"] is None, f"a verdict from another user's directory was used: {out}"
    assert "not owned by the current user" in err, err


def test_a_verdict_written_by_another_kvpatch_version_is_ignored(tmp_path):
    directory = tmp_path / "verdicts"
    _plant_verdict(directory, "k", version="0.0.0-other")
    out, _ = _lookup(tmp_path, directory)
    assert out["found"] is None, out


def test_a_fifo_as_the_verdict_file_never_blocks(tmp_path):
    directory = tmp_path / "verdicts"
    directory.mkdir()
    os.mkfifo(directory / "verdicts.json")
    try:
        out, _ = _lookup(tmp_path, directory)
    except Exception as exc:  # subprocess.TimeoutExpired: the read blocked on the FIFO
        pytest.fail(f"reading a FIFO verdict file blocked: {type(exc).__name__}")
    assert out["found"] is None


def test_a_symlink_to_dev_zero_is_not_read(tmp_path):
    directory = tmp_path / "verdicts"
    directory.mkdir()
    (directory / "verdicts.json").symlink_to("/dev/zero")
    code = "import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n" + LOOKUP
    proc = run_child([*SAFE, "-c", code, "k"], {"KVPATCH_VERDICTS": str(directory)}, tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = last_json(proc.stdout)
    assert out["found"] is None
    assert out["rss_mb"] < 400, f"the child read from /dev/zero: peak {out['rss_mb']} MiB"


STORE = textwrap.dedent(
    """
    import json, time
    from kvpatch import verdicts
    from kvpatch.detect import Source, Upstream
    from kvpatch.record import Expiry, Patch
    p = Patch(id="demo", summary="demo", distribution="mlx-lm", affected="<1", checked_through="0.1",
              reference="none", expiry=Expiry("never"))
    up = {"mlx-lm": Upstream("mlx-lm", "0.3.0", Source())}
    ok = verdicts.store("k", p, verdicts.Verdict(verdicts.Outcome.FIXED, "", time.time(), "test"), up)
    print("@@" + json.dumps({"stored": ok, "memory": verdicts.lookup("k") is not None}))
    """
)


def test_a_symlinked_lock_file_is_not_followed(tmp_path):
    directory = tmp_path / "verdicts"
    directory.mkdir()
    victim = tmp_path / "victim"
    (directory / "verdicts.lock").symlink_to(victim)
    proc = run_child([*SAFE, "-c", STORE], {"KVPATCH_VERDICTS": str(directory)}, tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not victim.exists(), "the lock was created through a planted symlink"
    out = last_json(proc.stdout)
    assert out == {"stored": False, "memory": True}, out  # kept in memory, and the caller is told


def _wait_for_lock(path: Path, limit: float = 300) -> None:
    """Until no process holds ``path`` locked (the background verifier releases it when it exits)."""
    deadline = time.monotonic() + limit
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail("the background verifier did not finish")
                time.sleep(0.2)
    finally:
        os.close(fd)


REQUEST = textwrap.dedent(
    """
    import json
    from kvpatch import measurer
    print("@@" + json.dumps({"said": measurer.request_verification(["k"])}))
    """
)

PLANT = "import os, sys\nopen(os.path.join({where!r}, 'PLANTED-RAN'), 'w').write(repr(sys.argv))\n"


def test_the_background_verifier_runs_no_code_from_the_verdict_directory_or_the_cwd(tmp_path):
    directory = tmp_path / "verdicts"
    cwd = tmp_path / "cwd"
    for where in (directory, cwd):
        (where / "kvpatch").mkdir(parents=True)
        (where / "kvpatch" / "__init__.py").write_text(PLANT.format(where=str(where)))
        (where / "kvpatch" / "__main__.py").write_text("")
    env = {"KVPATCH_VERDICTS": str(directory), "KVPATCH_VERIFY": "auto"}
    proc = run_child([*SAFE, "-c", REQUEST], env, cwd, timeout=60)
    assert proc.returncode == 0, proc.stderr
    said = last_json(proc.stdout)["said"]
    assert "verifying in the background" in said, said
    _wait_for_lock(directory / "verify.lock")
    planted = [str(p) for p in (directory / "PLANTED-RAN", cwd / "PLANTED-RAN") if p.exists()]
    assert not planted, f"the background verifier ran a planted kvpatch package: {planted}"
    log = (directory / "verify.log").read_text()
    assert "kvpatch verify" in log, log  # the real verifier ran (and said so in its log)
    assert stat.S_IMODE((directory / "verify.log").stat().st_mode) == 0o600


def test_a_symlinked_log_is_not_followed(tmp_path):
    directory = tmp_path / "verdicts"
    directory.mkdir()
    victim = tmp_path / "victim.log"
    (directory / "verify.log").symlink_to(victim)
    env = {"KVPATCH_VERDICTS": str(directory), "KVPATCH_VERIFY": "auto"}
    proc = run_child([*SAFE, "-c", REQUEST], env, tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    if (directory / "verify.lock").exists():
        _wait_for_lock(directory / "verify.lock")
    assert not victim.exists(), "the verifier's log was written through a planted symlink"


def test_the_pytest_plugins_verifier_runs_no_code_from_the_session_directory(tmp_path):
    """``pytest --kvpatch-verify`` in a directory holding a ``kvpatch`` package: the plugin's child verifier runs
    the installed kvpatch, not that one (the session itself runs with ``-P``, as a careful user's would)."""
    cwd = tmp_path / "project"
    (cwd / "kvpatch").mkdir(parents=True)
    (cwd / "kvpatch" / "__init__.py").write_text(PLANT.format(where=str(cwd)))
    (cwd / "kvpatch" / "__main__.py").write_text("")
    (cwd / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    env = {"KVPATCH_VERDICTS": str(tmp_path / "verdicts")}
    proc = run_child(
        [*SAFE, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--kvpatch-verify", "test_nothing.py"],
        env,
        cwd,
        timeout=600,
    )
    assert not (cwd / "PLANTED-RAN").exists(), "the plugin's verifier ran a planted kvpatch package"
    assert "kvpatch verify" in proc.stdout + proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
