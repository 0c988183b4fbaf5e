"""Trust ends at the owner: kvpatch's state directories, as another user or a planted file would leave them.

Each test starts the real installed kvpatch in a child process whose verdicts live in a directory the
test prepares (``KVPATCH_VERDICTS``), then checks what kvpatch read, wrote or ran.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from faults_support import REQUEST, SAFE, last_json, run_child, wait_for_lock

from kvpatch.store import MAX_BYTES

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


#: A child's address space bounded, so that an unbounded read fails instead of filling the machine's memory.
BOUNDED = "import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"


def test_a_symlink_to_dev_zero_is_not_read(tmp_path):
    directory = tmp_path / "verdicts"
    directory.mkdir()
    (directory / "verdicts.json").symlink_to("/dev/zero")
    (tmp_path / "control").mkdir()
    peaks = {}
    for name in ("control", "verdicts"):  # the control: the same lookup in a directory without the file
        env = {"KVPATCH_VERDICTS": str(tmp_path / name)}
        proc = run_child([*SAFE, "-c", BOUNDED + LOOKUP, "k"], env, tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = last_json(proc.stdout)
        assert out["found"] is None
        peaks[name] = out["rss_mb"]
    # a read of /dev/zero bounded as every state file is (read_bytes) adds its bound; an unbounded one, gigabytes
    assert peaks["verdicts"] - peaks["control"] < (MAX_BYTES >> 20) + 64, f"the child read from /dev/zero: {peaks}"


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
    wait_for_lock(directory / "verify.lock")
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
        wait_for_lock(directory / "verify.lock")
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


# -- whose files: the file itself, every directory above it, and no step between the check and the read ----------


@pytest.mark.parametrize("who", ["another user", "anyone (mode 0666)"])
def test_a_verdict_file_another_user_could_write_is_refused_in_a_sticky_directory(tmp_path, who):
    """``KVPATCH_VERDICTS=/tmp``: a sticky, world-writable directory (owned by root) passes the directory check, so
    the file must pass its own: a ``verdicts.json`` another user wrote there, or that anyone may rewrite, is not read
    (its "bug absent upstream" verdicts would turn fixes off)."""
    directory = tmp_path / "tmp"
    _plant_verdict(directory, "k")
    directory.chmod(0o1777)
    planted = directory / "verdicts.json"
    if who == "another user":
        if not hasattr(os, "geteuid") or os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(planted, 1234, 1234)
    else:
        planted.chmod(0o666)
    out, err = _lookup(tmp_path, directory)
    assert out["found"] is None, f"a verdict file {who} could write was used: {out}"
    lines = [ln for ln in err.splitlines() if "verdicts.json" in ln]
    why = "not owned by the current user" if who == "another user" else "writable by others"
    assert len(lines) == 1 and why in lines[0], err


@pytest.mark.parametrize("mode", [0o777, 0o1777])
def test_a_parent_others_can_write_is_refused_unless_sticky(tmp_path, mode):
    """A directory above the chosen one that others can write (not sticky) lets them rename the chosen one away
    and put their own in its place: refused, however trustworthy the chosen directory itself looks."""
    shared = tmp_path / "shared"
    directory = shared / "verdicts"
    _plant_verdict(directory, "k")
    shared.chmod(mode)
    out, err = _lookup(tmp_path, directory)
    if mode & 0o1000:  # sticky: only the owner renames what it owns
        assert out["found"] == "bug absent upstream", (out, err)
        return
    assert out["found"] is None, f"a verdict below a directory others can write was used: {out}"
    lines = [ln for ln in err.splitlines() if str(shared) in ln]
    assert len(lines) == 1 and "writable by others" in lines[0], err


#: Reads and writes verdicts in a loop while another process swaps the directory for a symbolic link and back;
#: prints what the reads found, and what one more read finds once the swapping is over.
RACE = textwrap.dedent(
    """
    import collections, json, sys, time, warnings
    warnings.simplefilter("ignore")
    from kvpatch import verdicts
    from kvpatch.detect import Source, Upstream
    from kvpatch.record import Expiry, Patch
    p = Patch(id="demo", summary="demo", distribution="mlx-lm", affected="<1", checked_through="0.1",
              reference="none", expiry=Expiry("never"))
    up = {"mlx-lm": Upstream("mlx-lm", "0.3.0", Source())}
    seen = collections.Counter()
    swapping, done = float(sys.argv[1]), sys.argv[2]
    end = time.monotonic() + swapping
    while time.monotonic() < end:
        verdicts._loaded = None
        found = verdicts.lookup("k")
        seen[found.outcome.value if found else "none"] += 1
        if sum(seen.values()) % 10 == 0:
            verdicts.store("w", p, verdicts.Verdict(verdicts.Outcome.FIXED, "", time.time(), "race"), up)
    while not __import__("os").path.exists(done):
        time.sleep(0.05)
    verdicts._loaded = None
    found = verdicts.lookup("k")
    print("@@" + json.dumps({"during": seen, "after": found.outcome.value if found else None}))
    """
)

SWAP = textwrap.dedent(
    """
    import os, shutil, sys, time
    chosen, forged, end, done = sys.argv[1], sys.argv[2], time.monotonic() + float(sys.argv[3]), sys.argv[4]

    def clear():  # what a writer made at the chosen path while it was away
        if os.path.islink(chosen):
            os.unlink(chosen)
        else:
            shutil.rmtree(chosen, ignore_errors=True)

    while time.monotonic() < end:
        os.rename(chosen, chosen + ".real")
        while True:
            try:
                os.symlink(forged, chosen)
                break
            except FileExistsError:
                clear()
        os.unlink(chosen)
        while True:
            try:
                os.rename(chosen + ".real", chosen)
                break
            except OSError:
                clear()
        time.sleep(0.0002)
    open(done, "w").close()
    """
)


def test_what_was_checked_is_what_is_read(tmp_path):
    """The directory is swapped for a symbolic link to a forged one (which the check refuses: others can write it)
    and back, as fast as a process can, while verdicts are read and written: every read is of the checked directory
    or nothing, nothing is written into the forged one, and nothing stored is lost."""
    chosen = tmp_path / "base" / "verdicts"
    _plant_verdict(chosen, "k")
    forged = tmp_path / "forged"
    _plant_verdict(forged, "k")
    forged.chmod(0o777)
    planted = {p.name: p.read_bytes() for p in forged.iterdir()}
    genuine = json.loads((chosen / "verdicts.json").read_text())
    genuine["verdicts"]["k"]["outcome"] = "bug present, fixed by patch"
    (chosen / "verdicts.json").write_text(json.dumps(genuine))
    done = tmp_path / "swapped"
    swapper = subprocess.Popen([sys.executable, *SAFE, "-c", SWAP, str(chosen), str(forged), "6", str(done)])
    try:
        proc = run_child([*SAFE, "-c", RACE, "6", str(done)], {"KVPATCH_VERDICTS": str(chosen)}, tmp_path, timeout=120)
    finally:
        swapper.wait(timeout=60)
    assert proc.returncode == 0 and swapper.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    assert "bug absent upstream" not in out["during"], f"a forged verdict was read: {out}"
    assert {p.name: p.read_bytes() for p in forged.iterdir()} == planted, "a write went into the forged directory"
    assert out["after"] == "bug present, fixed by patch", f"the stored verdict was lost: {out}"


@pytest.mark.parametrize("variable", ["KVPATCH_VERDICTS", "KVPATCH_CACHE", "XDG_CACHE_HOME"])
def test_a_relative_state_directory_is_ignored_with_one_warning(tmp_path, monkeypatch, variable):
    """A relative path names another directory in each working directory (and the background verifier's is
    ``/``): every place kvpatch uses is absolute, the relative setting is ignored, with one warning."""
    from kvpatch import _warn, config, store

    monkeypatch.setattr(_warn, "_emitted", set())
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("KVPATCH_VERDICTS", "KVPATCH_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "relcache")
    with pytest.warns(_warn.KvpatchWarning, match=f"{variable}='relcache' is a relative path") as caught:
        places = [*store.verdict_places(), store.env_dir(), store.verdict_places()[-1]]
    assert len([w for w in caught if variable in str(w.message)]) == 1
    assert all(p is not None and p.path.is_absolute() and p.anchor.is_absolute() for p in places), places
    assert any(variable in problem for problem in config.read_config().problems)


def test_status_with_a_relative_cache_creates_nothing_in_the_working_directory(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {"KVPATCH_CACHE": "relcache", "HOME": str(tmp_path / "home"), "KVPATCH_VERDICTS": str(tmp_path / "v")}
    proc = run_child([*SAFE, "-m", "kvpatch", "status"], env, cwd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(cwd.iterdir()) == [], "status created state in the working directory"
    assert len([ln for ln in proc.stderr.splitlines() if "KVPATCH_CACHE='relcache'" in ln]) == 1, proc.stderr


def test_a_line_break_in_a_configured_path_forges_no_line(tmp_path):
    """The warnings quote the paths they name: a newline in one is shown escaped, never as a line of its own."""
    directory = tmp_path / "v\nkvpatch: all fixes verified"
    _plant_verdict(directory, "k")
    directory.chmod(0o777)
    out, err = _lookup(tmp_path, directory)
    assert out["found"] is None
    assert not [ln for ln in err.splitlines() if ln.startswith("kvpatch: all fixes")], err
    assert "v\\nkvpatch: all fixes verified" in err, err
