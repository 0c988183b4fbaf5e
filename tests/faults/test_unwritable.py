"""A cache that cannot be read or written never disables a fix, and a lost write is never reported as done.

Children of the real installed kvpatch with state directories that cannot be entered, no home directory,
a full disk, an install outside ``sys.prefix`` (``--target`` / ``--user``), and a settled ``status``
outcome whose inputs changed underneath it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from faults_support import REPO, SAFE, last_json, run_child

#: Import upstream as a user's program does; report each patch's state.
NO_PASSWD = textwrap.dedent(
    """
    import pwd, runpy, sys
    def _missing(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")
    pwd.getpwuid = _missing
    sys.argv = ["kvpatch", *sys.argv[1:]]
    runpy.run_module("kvpatch", run_name="__main__", alter_sys=True)
    """
)


#: ``python -m kvpatch ...`` on a full disk: every rename into place fails with ENOSPC.
def test_status_without_a_home_directory(tmp_path):
    """``HOME`` unset and a uid with no passwd entry: status works (nothing to cache the outcome in)."""
    env = {"HOME": None, "XDG_CACHE_HOME": None, "KVPATCH_CACHE": None, "KVPATCH_VERDICTS": str(tmp_path / "v")}
    proc = run_child([*SAFE, "-c", NO_PASSWD, "status"], env, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "internal error" not in proc.stdout + proc.stderr


# -- a verdict that could not be stored ----------------------------------------------------------------------


# -- the settled status outcome ---------------------------------------------------------------------------------


# -- installs outside sys.prefix ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_install(tmp_path_factory) -> Path:
    """``pip install --target`` of this checkout (no dependencies: those come from the test environment)."""
    target = tmp_path_factory.mktemp("target")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
         str(REPO)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"pip install --target failed: {proc.stderr[-500:]}")
    return target


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """An interpreter environment without kvpatch (and without pip)."""
    root = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=300)
    return root


def site_packages() -> str:
    import sysconfig

    return sysconfig.get_paths()["purelib"]


def _bare_python(bare_venv: Path) -> str:
    return str(bare_venv / ("Scripts" if os.name == "nt" else "bin") / "python")


def test_status_says_a_target_install_is_not_auto_activated(tmp_path, target_install, bare_venv):
    env = child_env_for_target(target_install)
    proc = subprocess.run(
        [_bare_python(bare_venv), "-m", "kvpatch", "status"], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(target_install) in _kvpatch_file(bare_venv, env, tmp_path)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("auto-activation: off")]
    assert len(lines) == 1 and "kvpatch.pth is not in a site directory" in lines[0], proc.stdout
    # where the .pth is processed (the test environment itself) nothing is said
    own = run_child(["-m", "kvpatch", "status"], {}, tmp_path)
    assert "auto-activation" not in own.stdout, own.stdout


def test_an_install_outside_sys_prefix_writes_nothing_under_sys_prefix(tmp_path, target_install, bare_venv):
    """A ``--user`` or ``--target`` kvpatch keeps its state in the per-user place, never in the running
    interpreter's ``<prefix>/var/cache/kvpatch`` (the base interpreter's, for a ``--user`` install)."""
    env = child_env_for_target(target_install)
    env.pop("KVPATCH_VERDICTS")
    env["KVPATCH_CACHE"] = str(tmp_path / "cache")
    store = textwrap.dedent(
        """
        import json, time
        from kvpatch import verdicts
        from kvpatch.detect import Source, Upstream
        from kvpatch.record import Expiry, Patch
        p = Patch(id="demo", summary="demo", distribution="mlx-lm", affected="<1", checked_through="0.1",
                  reference="none", expiry=Expiry("never"))
        up = {"mlx-lm": Upstream("mlx-lm", "0.3.0", Source())}
        ok = verdicts.store("k", p, verdicts.Verdict(verdicts.Outcome.FIXED, "", time.time(), "test"), up)
        print("@@" + json.dumps({"stored": ok}))
        """
    )
    proc = subprocess.run(
        [_bare_python(bare_venv), "-c", store], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    assert not (bare_venv / "var").exists(), "a kvpatch installed outside sys.prefix wrote under sys.prefix"
    assert out["stored"] and list((tmp_path / "cache").rglob("verdicts.json")), out


def child_env_for_target(target: Path) -> dict[str, str]:
    from faults_support import child_env

    env = child_env({"PYTHONPATH": os.pathsep.join([str(target), site_packages()])})
    env.pop("PYTHONHOME", None)
    return env


def _kvpatch_file(bare_venv: Path, env: dict[str, str], cwd: Path) -> str:
    proc = subprocess.run(
        [_bare_python(bare_venv), "-c", "import kvpatch; print(kvpatch.__file__)"], env=env, cwd=cwd,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return proc.stdout.strip()
