"""A cache that cannot be entered or written, with real mlx-lm: no fix is lost, no lost write is reported as done,
and a settled ``status`` outcome never outlives its inputs (the fault suite's cases that need upstream; the rest are
in tests/faults).
"""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest
from faults_support import SAFE, last_json, newer_release_overlay, run_child, site_packages, unprivileged

IMPORT = textwrap.dedent(
    """
    import json
    import mlx_lm, mlx_lm.models.cache, mlx_lm.generate
    import kvpatch
    e = kvpatch.get_engine()
    print("@@" + json.dumps({p.id: e.status[p.id].state.value for p in e.patches}))
    """
)

#: Why a test that needs a patch applied by the installed release skips: an archive, editable or git install of
#: upstream (the GPU host's wheels) leaves every patch in range to its reproduction, and a fresh cache has no verdict.
BY_VERDICT = "no patch applies by release here: upstream is not an index install, so the reproduction decides each"

#: ``python -m kvpatch ...`` with the passwd database saying this uid has no entry.


DISK_FULL = textwrap.dedent(
    """
    import errno, os, runpy, sys
    def _full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    os.replace = _full
    sys.argv = ["kvpatch", *sys.argv[1:]]
    runpy.run_module("kvpatch", run_name="__main__", alter_sys=True)
    """
)


def test_a_cache_that_cannot_be_entered_disables_no_fix(tmp_path):
    """``HOME`` and the verdict directory's parent at mode 000 (Docker's ``--user`` with ``HOME=/root``):
    every patch ends as it does with a writable cache, and ``status --check`` exits as it does there."""
    good = {"HOME": str(tmp_path / "home-ok"), "KVPATCH_VERDICTS": str(tmp_path / "ok" / "v"), "KVPATCH_CACHE": None}
    (tmp_path / "home-ok").mkdir()
    locked = tmp_path / "locked"
    locked.mkdir()
    bad = {"HOME": str(locked), "KVPATCH_VERDICTS": str(locked / "v"), "KVPATCH_CACHE": None, "XDG_CACHE_HOME": None}
    control = run_child(["-c", IMPORT], good, tmp_path)
    assert control.returncode == 0, control.stderr[-3000:]
    expected = last_json(control.stdout)
    if "applied" not in expected.values():
        pytest.skip(BY_VERDICT)
    locked.chmod(0)
    try:
        proc = run_child(["-c", IMPORT], bad, tmp_path, prefix=unprivileged())
        assert proc.returncode == 0, proc.stderr[-3000:]
        states = last_json(proc.stdout)
        said = [ln for ln in proc.stderr.splitlines() if "in memory" in ln]
        assert len(said) == 1 and "could not write" in said[0], proc.stderr[-3000:]  # one warning, no more
        assert states == expected, {k: (v, expected.get(k)) for k, v in states.items() if v != expected.get(k)}
        status = run_child(["-m", "kvpatch", "status", "--check"], bad, tmp_path, prefix=unprivileged())
        control_status = run_child(["-m", "kvpatch", "status", "--check"], good, tmp_path)
    finally:
        locked.chmod(0o700)
    assert status.returncode == control_status.returncode, status.stdout[-3000:] + status.stderr[-2000:]
    assert "failed" not in status.stdout.lower(), status.stdout


def test_verify_fails_when_a_verdict_was_not_stored_and_status_names_where_each_came_from(tmp_path):
    verdicts = tmp_path / "verdicts"
    path = os.pathsep.join([newer_release_overlay(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = {"PYTHONPATH": path, "KVPATCH_VERDICTS": str(verdicts), "KVPATCH_CACHE": str(tmp_path / "cache")}
    full = run_child([*SAFE, "-c", DISK_FULL, "verify"], env, tmp_path)
    assert full.returncode == 74, f"exit {full.returncode}\n{full.stdout[-2000:]}\n{full.stderr[-2000:]}"
    lines = [ln for ln in full.stderr.splitlines() if "NOT stored" in ln]
    assert len(lines) == 1 and "No space left on device" in lines[0], full.stderr[-2000:]
    # with room on the disk the same run stores them, and status says which file each verdict came from
    done = run_child(["-m", "kvpatch", "verify"], env, tmp_path)
    assert done.returncode in (0, 1), done.stdout[-2000:] + done.stderr[-2000:]
    status = run_child(["-m", "kvpatch", "status", "--json"], env, tmp_path)
    report = json.loads(status.stdout)
    decided = [p for p in report["patches"] if p["verdict"]]
    assert decided, [(p["id"], p["action"], p["state"]) for p in report["patches"]]
    assert {p["verdict_file"] for p in decided} == {str(verdicts / "verdicts.json")}, decided
    text = run_child(["-m", "kvpatch", "status", "-v"], env, tmp_path).stdout
    assert f"verdict:   {verdicts / 'verdicts.json'}" in text, text[-3000:]


def test_a_changed_fingerprint_is_not_hidden_by_the_settled_status_cache(tmp_path):
    """kvpatch as a directory copy (same version, same place): after its shipped fingerprints change,
    ``status --check`` must settle again, not repeat the outcome it cached before."""
    copy = tmp_path / "site"
    installed = Path(site_packages()) / "kvpatch"  # the installed one: a source checkout has no kvpatch/patches
    shutil.copytree(installed, copy / "kvpatch", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("_kvpatch_boot.py", "_kvpatch_hooks.py"):  # the wheel puts the bootstrap beside the package
        shutil.copy2(installed.parent / name, copy / name)
    path = os.pathsep.join([str(copy), os.environ.get("PYTHONPATH", "")])
    env = {"PYTHONPATH": path, "KVPATCH_CACHE": str(tmp_path / "cache"), "KVPATCH_VERDICTS": str(tmp_path / "v")}

    def status() -> dict:
        proc = run_child([*SAFE, "-m", "kvpatch", "status", "--check", "--json"], env, tmp_path)
        assert proc.returncode in (0, 1, 2), proc.stderr[-3000:]
        return json.loads(proc.stdout)

    first = status()
    applied = [p for p in first["patches"] if p["state"] == "applied" and p["action"] == "apply"]
    table = json.loads((copy / "kvpatch" / "data" / "fingerprints.json").read_text())
    victim = next((p["id"] for p in applied if p["id"] in table["patches"]), None)
    if victim is None and not any(p["action"] == "apply" for p in first["patches"]):
        pytest.skip(BY_VERDICT)
    assert victim, ("no applied patch with recorded fingerprints in this bucket", first["summary"])
    assert status()["settled"]["how"] == "cache"  # nothing changed: the outcome is reused
    for target in table["patches"][victim]:
        table["patches"][victim][target] = {"0" * 12: ["0.0.0"]}  # a fingerprint no installed code has
    (copy / "kvpatch" / "data" / "fingerprints.json").write_text(json.dumps(table))
    after = status()
    state = next(p["state"] for p in after["patches"] if p["id"] == victim)
    assert after["settled"]["how"] == "now" and state != "applied", (after["settled"], state)
    assert after["check"]["exit"] != 0, after["check"]
