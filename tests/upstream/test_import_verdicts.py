"""Verdicts, not workloads: the user's import never runs a reproduction and never changes mlx's global state.

For every install source (index, archive, editable, git with a commit the index does not know) and for
a release newer than every record's ``checked_through`` (simulated by editing the version in a copy of
the real release's METADATA), ``mx.random.seed(42); import mlx_lm, mlx_lm.generate;
mx.random.normal((3,))`` gives the same numbers with kvpatch active as with ``KVPATCH=off``, and
``kvpatch.engine.REPRODUCTIONS_RUN`` (appended to by every reproduction run) stays empty in that
process. A patch the reproduction decides is then ``pending verification`` (no verdict yet), or applied
from the verdict that ``python -m kvpatch verify`` (or the background verification) stored.

The overlay is a copy of the real ``.dist-info`` directories put first on ``PYTHONPATH``: the code
that runs is the real release's; only what the metadata says changes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version
from support import child_env


def _installed(dist: str) -> bool:
    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


DISTS = [d for d in ("mlx-lm", "mlx-vlm") if _installed(d)]

KINDS = {
    "index": None,
    "archive": {"url": "file:///tmp/wheels/upstream-0-py3-none-any.whl", "archive_info": {}},
    "editable": {"url": "file:///src/upstream", "dir_info": {"editable": True}},
    "directory": {"url": "file:///src/upstream", "dir_info": {}},
    "git": {
        "url": "https://github.com/example/fork",
        "vcs_info": {"vcs": "git", "commit_id": "0123456789abcdef0123456789abcdef01234567"},
    },
    "newer": None,  # an index install whose METADATA says a release newer than checked_through
}

PROGRAM = """
import json, sys
import mlx.core as mx
mx.random.seed(42)
import mlx_lm, mlx_lm.generate
{vlm}
numbers = mx.random.normal((3,)).tolist()
out = {{"numbers": numbers, "kvpatch": "kvpatch" in sys.modules}}
if "kvpatch" in sys.modules:
    import kvpatch
    from kvpatch import engine
    e = kvpatch.get_engine()
    out["reproductions"] = list(engine.REPRODUCTIONS_RUN)
    out["states"] = {{p.id: [e.status[p.id].state.value, e.status[p.id].decision.action.value, e.status[p.id].reason]
                     for p in e.patches}}
print("@@" + json.dumps(out))
"""


def _program() -> str:
    vlm = "import mlx_vlm, mlx_vlm.models.cache" if "mlx-vlm" in DISTS else ""
    return PROGRAM.format(vlm=vlm)


def _overlay(tmp: Path, kind: str) -> str:
    """A directory with copies of the installed upstream's .dist-info, changed as ``kind`` says."""
    root = tmp / f"overlay-{kind}"
    if root.exists():
        return str(root)
    root.mkdir(parents=True)
    for dist in DISTS:
        info = Path(str(metadata.distribution(dist)._path))  # type: ignore[attr-defined]
        dest = root / info.name
        shutil.copytree(info, dest)
        if kind == "newer":
            meta = dest / "METADATA"
            version = metadata.version(dist)
            meta.write_text(meta.read_text().replace(f"\nVersion: {version}\n", f"\nVersion: {_newer(dist)}\n", 1))
        elif KINDS[kind] is not None:
            direct = dict(KINDS[kind])
            (dest / "direct_url.json").write_text(json.dumps(direct))
    return str(root)


def _run(code: str, env: dict[str, str], cwd: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", code], env=child_env(env), cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@")][-1]
    return json.loads(line[2:])


def _env(tmp_path: Path, kind: str, **extra: str) -> dict[str, str]:
    env = {
        "PYTHONPATH": os.pathsep.join([_overlay(tmp_path, kind), os.environ.get("PYTHONPATH", "")]),
        "KVPATCH_VERDICTS": str(tmp_path / f"verdicts-{kind}"),
    }
    env.update(extra)
    return env


pytestmark = pytest.mark.skipif("mlx-lm" not in DISTS, reason="needs mlx-lm")


def _newer(dist: str) -> str:
    version = Version(metadata.version(dist))
    return f"{version.major}.{version.minor}.{version.micro + 1}"


def _left_to_reproduction() -> list[str]:
    """Ids the gate leaves to the reproduction once the installed releases claim to be one micro release newer."""
    from kvpatch import registry
    from kvpatch.config import Config
    from kvpatch.detect import Upstream
    from kvpatch.gate import Action, decide

    out = []
    for patch in registry.load().patches:
        if patch.distribution in DISTS:
            upstream = Upstream(patch.distribution, _newer(patch.distribution))
            if decide(patch, upstream, Config()).action is Action.VERIFY:
                out.append(patch.id)
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_import_runs_no_reproduction_and_keeps_random_state(tmp_path, kind):
    off = _run(_program(), _env(tmp_path, kind, KVPATCH="off"), tmp_path)
    # no background verification here: this test is about the importing process alone
    on = _run(_program(), _env(tmp_path, kind, KVPATCH_VERIFY="never"), tmp_path)
    assert not off["kvpatch"]
    assert on["kvpatch"], "the .pth bootstrap did not activate kvpatch"
    print(
        f"{kind}: with kvpatch {on['numbers']}, KVPATCH=off {off['numbers']}; reproductions run: {on['reproductions']}"
    )
    assert on["numbers"] == off["numbers"], (kind, on["numbers"], off["numbers"])
    assert on["reproductions"] == [], f"reproductions ran inside the import: {on['reproductions']}"
    decided = {pid: s for pid, s in on["states"].items() if s[1] == "verify"}
    if kind in ("archive", "editable", "directory", "git", "newer"):
        # whatever the reproduction decides is left pending, never measured in the user's import
        for pid, (state, _, reason) in decided.items():
            if state == "not needed" and "the patch declined this backend" in reason:
                continue  # its builders decline here (e.g. a CUDA-only fix on the CPU): no verdict is needed
            assert state in ("pending verification", "pending"), (pid, state, reason)
            if state == "pending verification":
                assert "KVPATCH_VERIFY=never" in reason and "kvpatch verify" in reason, reason
    if kind == "newer":
        assert set(decided) == set(_left_to_reproduction()), decided
    assert not any(s[0] == "applied" for s in decided.values())


def test_verdict_from_kvpatch_verify_is_read_at_import(tmp_path):
    """``kvpatch verify`` measures the open patches once; a later import applies them from the verdict, with
    no reproduction and the same random numbers."""
    kind = "newer"
    if not _left_to_reproduction():
        pytest.skip("no patch has this release as its checked_through: nothing is left to a reproduction")
    env = _env(tmp_path, kind)
    proc = subprocess.run(
        [sys.executable, "-m", "kvpatch", "verify", "--json"],
        env=child_env(env),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    report = json.loads(proc.stdout)
    verdicts = {r["id"]: r for r in report["patches"] if r["verdict"]}
    assert verdicts, report
    assert Path(report["cache"]).is_file()
    off = _run(_program(), _env(tmp_path, kind, KVPATCH="off"), tmp_path)
    on = _run(_program(), _env(tmp_path, kind, KVPATCH_VERIFY="never"), tmp_path)
    assert on["numbers"] == off["numbers"]
    assert on["reproductions"] == []
    for pid, row in verdicts.items():
        state, _action, reason = on["states"][pid]
        if row["verdict"].startswith("bug present, fixed by patch"):
            if state == "opt-in":
                continue  # a behaviour change stays off without KVPATCH_ENABLE, whatever the verdict
            assert state in ("applied", "pending"), (pid, state, reason)  # pending: its modules not imported
            assert "verdict: bug present, fixed by patch" in reason
        elif row["verdict"].startswith("bug absent upstream"):
            assert state == "not needed", (pid, state, reason)


def test_first_use_starts_one_background_verification(tmp_path):
    """No verdict: the import is not blocked, the patch is not applied, one detached verification runs and
    stores the verdict; the next process applies the patch from it."""
    kind = "newer"
    if not _left_to_reproduction():
        pytest.skip("no patch has this release as its checked_through: nothing is left to a reproduction")
    env = _env(tmp_path, kind, KVPATCH_VERIFY="auto")
    started = time.monotonic()
    first = _run(_program(), env, tmp_path)
    assert first["reproductions"] == []
    pending = {pid: s for pid, s in first["states"].items() if s[0] == "pending verification"}
    assert pending, first["states"]
    assert all("verifying in the background (pid" in s[2] for s in pending.values()), pending
    # a second process while it runs does not start another
    second = _run(_program(), env, tmp_path)
    assert all(
        "a verification is running" in s[2] or "has not settled it" in s[2] or s[0] != "pending verification"
        for s in second["states"].values()
        if s[0] == "pending verification"
    ), second["states"]
    cache = tmp_path / f"verdicts-{kind}" / "verdicts.json"
    deadline = started + 900
    while time.monotonic() < deadline:
        try:
            data = json.loads(cache.read_text())
        except (OSError, ValueError):
            data = {}
        if len(data.get("verdicts", {})) >= len(pending) and not _lock_held(cache.parent / "verify.lock"):
            break
        time.sleep(2)
    else:
        log = (cache.parent / "verify.log").read_text() if (cache.parent / "verify.log").exists() else ""
        pytest.fail(f"no verdicts after 900 s; log:\n{log[-3000:]}")
    third = _run(_program(), env, tmp_path)
    assert third["reproductions"] == []
    assert not any(s[0] == "pending verification" for s in third["states"].values()), third["states"]
    off = _run(_program(), _env(tmp_path, kind, KVPATCH="off"), tmp_path)
    assert first["numbers"] == second["numbers"] == third["numbers"] == off["numbers"]


def _lock_held(path: Path) -> bool:
    import fcntl

    with path.open("a") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    return False


SERVER_FIX_FIRST = """
import json, sys
import mlx_lm.models.cache as C
from kvpatch import registry
from kvpatch.config import Config
from kvpatch.engine import Engine
from kvpatch.gate import Action
from kvpatch.status import build_report
from kvpatch.testing import natural_decision

reg = registry.load()
patch = next(p for p in reg.patches if p.id == "rotating-merge-empty")
if natural_decision(patch).action is not Action.APPLY:
    print("@@" + json.dumps(None)); raise SystemExit
target = patch.targets[0]
original = vars(C.BatchRotatingKVCache)["merge"].__func__
# a server's own fix of the same bug, installed before kvpatch (a plain function of the server's module)
server_fix = patch.builders[target](original)
server_fix.__module__, server_fix.__qualname__ = "some_server.patches", "fixed_merge"
server_fix.__wrapped__ = original  # a well-behaved wrapper (functools.wraps): kvpatch sees upstream's code under it
C.BatchRotatingKVCache.merge = classmethod(server_fix)
engine = Engine(reg.patches, config=Config())
engine.activate()
report = build_report(engine, verify=True)
entry = next(p for p in report.data["patches"] if p["id"] == patch.id)
print("@@" + json.dumps({"state": entry["state"], "verify": entry["verify"], "check": report.data["check"]}))
"""


def test_verify_credits_a_server_fix_to_the_server_not_upstream(tmp_path):
    """Issue 11 item 3: with a server's own fix under kvpatch's, the bug is absent with kvpatch's patch taken
    out, but that is the server's doing: status --verify says so and advises no record edit."""
    out = _run(SERVER_FIX_FIRST, {"KVPATCH": "off", "KVPATCH_VERDICTS": str(tmp_path / "v")}, tmp_path)
    if out is None:
        pytest.skip("rotating-merge-empty does not apply to this release")
    assert out["state"] == "applied", out
    outcome = out["verify"]["outcome"]
    assert outcome.startswith("bug absent in this process, fixed by something else in this process"), outcome
    assert "some_server.patches.fixed_merge" in outcome, outcome
    assert not [r for r in out["check"]["reasons"] if r.startswith("rotating-merge-empty")], out["check"]


VERIFY_IN_PROCESS = r"""
import argparse, contextlib, gc, io, json
import kvpatch
from kvpatch import cli
from kvpatch.engine import Engine

engine = kvpatch.get_engine()
with contextlib.redirect_stdout(io.StringIO()) as out:
    cli.cmd_verify(argparse.Namespace(background=None, json=True, missing=False))
rows = {r["id"]: r["action"] for r in json.loads(out.getvalue())["patches"]}
print("@@" + json.dumps({
    "engines": sum(isinstance(o, Engine) for o in gc.get_objects()),
    "same": kvpatch.get_engine() is engine,
    "rows": rows,
    "engine": {pid: engine.status[pid].decision.action.value for pid in rows},
}))
"""


def test_verify_decides_every_patch_with_the_process_engine(tmp_path):
    """``kvpatch verify`` considers every patch whatever ``KVPATCH_DISABLE`` says, with the process's one engine:
    what it measured is what that engine holds."""
    out = _run(VERIFY_IN_PROCESS, _env(tmp_path, "index", KVPATCH_DISABLE="*", KVPATCH_VERIFY="never"), tmp_path)
    assert out["engines"] == 1 and out["same"], out["engines"]
    assert out["rows"] and "disabled" not in out["rows"].values(), out["rows"]
    assert out["engine"] == out["rows"]
