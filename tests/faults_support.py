"""What the fault tests share (a plain module, as tests/support.py is): child processes of the real installed kvpatch, run the way a hostile
environment or a careless operator would run them.

The fault tests that need upstream are tests/upstream/test_store_faults.py (run in the newest mlx-lm bucket); the
others, tests/faults, run anywhere. As root, "a user who may not enter a directory" is a child without the
capabilities that let root past file modes (``setpriv``); elsewhere the test user already is one.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support import REPO, child_env

#: The interpreter flag that keeps a child's working directory off its sys.path (3.11+).
SAFE = ["-P"] if sys.version_info >= (3, 11) else []

__all__ = [
    "REPO",
    "REQUEST",
    "SAFE",
    "child_env",
    "fork_while_busy",
    "last_json",
    "newer_release_overlay",
    "run_child",
    "site_packages",
    "unprivileged",
    "wait_for_lock",
]

#: A child that asks for a background verification of the key "k": prints what it was told, and whether the
#: verifier is left as a child of its own.
REQUEST = textwrap.dedent(
    """
    import json, os
    from kvpatch import verifier
    said = verifier.request_verification(["k"])
    try:
        os.waitpid(-1, os.WNOHANG)
        child = True
    except ChildProcessError:
        child = False
    print("@@" + json.dumps({"said": said, "child": child}))
    """
)


def unprivileged() -> list[str]:
    """The command prefix that makes file modes apply to the child (empty when they already do)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: file modes do not apply to root")
    caps = "-dac_override,-dac_read_search"
    return [setpriv, f"--inh-caps={caps}", f"--bounding-set={caps}"]


def run_child(
    args: list[str],
    env: dict[str, str],
    cwd: Path,
    *,
    prefix: list[str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """``python <args>`` with the session's child environment plus ``env`` (a value of None removes it)."""
    environ = child_env({k: v for k, v in env.items() if v is not None})
    for k, v in env.items():
        if v is None:
            environ.pop(k, None)
    return subprocess.run(
        [*(prefix or []), sys.executable, *args],
        env=environ,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def last_json(stdout: str) -> dict:
    return json.loads([ln for ln in stdout.splitlines() if ln.startswith("@@")][-1][2:])


def site_packages() -> str:
    """This interpreter's site-packages (where the test environment installed kvpatch)."""
    import sysconfig

    return sysconfig.get_paths()["purelib"]


def newer_release_overlay(tmp_path: Path, distribution: str = "mlx-lm") -> str:
    """A folder for ``PYTHONPATH`` holding a copy of ``distribution``'s .dist-info that says one micro release newer:
    every patch of it goes to its reproduction (a verdict decides)."""
    from importlib import metadata

    root = tmp_path / "overlay"
    info = Path(str(metadata.distribution(distribution)._path))  # type: ignore[attr-defined]
    dest = root / info.name
    shutil.copytree(info, dest)
    version = metadata.version(distribution)
    major, minor, micro = (int(x) for x in version.split(".")[:3])
    meta = dest / "METADATA"
    meta.write_text(meta.read_text().replace(f"\nVersion: {version}\n", f"\nVersion: {major}.{minor}.{micro + 1}\n"))
    return str(root)


def wait_for_lock(path: Path, limit: float = 600) -> None:
    """Until no process holds ``path`` locked (the background verifier releases ``verify.lock`` when it exits)."""
    if not path.exists():
        return
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


_FORK_WHILE_BUSY = """
import json, os, sys, threading, time, warnings
warnings.simplefilter("ignore")  # 3.12+: fork in a process with threads warns
import kvpatch
{setup}
stop = False

def busy():
    while not stop:
{busy}

thread = threading.Thread(target=busy, daemon=True)
thread.start()
time.sleep(0.5)
pids = []
for _ in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
{child}
    pids.append(pid)
    time.sleep(0.05)
stop = True
hung, failed, deadline = 0, 0, time.monotonic() + 240
for pid in pids:
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            failed += os.waitstatus_to_exitcode(status) != 0
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            hung += 1
            break
        time.sleep(0.1)
print("@@" + json.dumps({{"hung": hung, "failed": failed, "forked": len(pids)}}))
"""


def fork_while_busy(busy: str, child: str, setup: str = "") -> str:
    """A child's code: a thread runs ``busy`` in a loop (inside kvpatch all the time) while the main thread forks
    ``sys.argv[1]`` children that run ``child`` (which ends with ``os._exit``); prints how many hung (killed after
    four minutes) and how many exited non-zero."""
    return _FORK_WHILE_BUSY.format(
        setup=textwrap.dedent(setup),
        busy=textwrap.indent(textwrap.dedent(busy), " " * 8),
        child=textwrap.indent(textwrap.dedent(child), " " * 8),
    )
