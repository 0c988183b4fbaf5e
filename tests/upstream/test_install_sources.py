"""Install sources on a real release: a git pin, an unknown commit and a corrupted direct_url.json.

A git install is simulated the way pip records one: the real release's ``.dist-info`` gets a PEP 610
``direct_url.json`` naming a commit, in an overlay directory put first on ``PYTHONPATH``. The code that
runs is the real release's; only the recorded source changes.
"""

from __future__ import annotations

import json
import os
import shutil
from importlib import metadata
from pathlib import Path

import pytest

from kvpatch import registry


def _overlay(tmp_path: Path, dist: str, direct_url: str) -> dict[str, str]:
    info = Path(str(metadata.distribution(dist)._path))  # type: ignore[attr-defined]
    dest = tmp_path / "overlay" / info.name
    shutil.copytree(info, dest)
    (dest / "direct_url.json").write_text(direct_url)
    return {"PYTHONPATH": os.pathsep.join([str(dest.parent), os.environ.get("PYTHONPATH", "")])}


def _status(run_py, env) -> dict:
    out = run_py(
        "import runpy, sys; sys.argv=['kvpatch','status','--json']; runpy.run_module('kvpatch', run_name='__main__')",
        env=env,
    )
    return json.loads(out)


def _git(commit: str, repo: str) -> str:
    return json.dumps({"url": f"https://github.com/{repo}", "vcs_info": {"vcs": "git", "commit_id": commit}})


def _require(dist: str, version: str | None = None) -> None:
    try:
        installed = metadata.version(dist)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{dist} not installed")
    if version and installed != version:
        pytest.skip(f"needs {dist} {version}, have {installed}")


# Pins downstream servers use, with what UPSTREAM-BUGS.md measured for them.
PINS = {
    "f96138ee": {"left-padding-mask": "apply", "batch-quantized-extend": "apply"},
    "fea81522": {"left-padding-mask": "not needed", "batch-quantized-extend": "apply"},
    "6f60ee44": {"left-padding-mask": "not needed", "batch-quantized-extend": "not needed"},
}


@pytest.mark.parametrize("pin", sorted(PINS))
def test_known_mlx_vlm_pins(run_py, tmp_path, pin):
    _require("mlx-vlm", "0.5.0")
    index = {line.split()[0][:8]: line.split()[0] for line in _index_lines("mlx-vlm")}
    data = _status(run_py, _overlay(tmp_path, "mlx-vlm", _git(index[pin], "Blaizzy/mlx-vlm")))
    assert data["upstream"]["mlx-vlm"]["source"]["commit"] == index[pin]
    actions = {p["id"]: p["action"] for p in data["patches"]}
    expected = {pid: action for pid, action in PINS[pin].items() if pid in actions}
    if not expected:
        pytest.skip("the pin-gated patches are not in the registry")
    assert {pid: actions[pid] for pid in expected} == expected
    for p in data["patches"]:
        if p["id"] in expected:
            assert pin in p["reason"]


def _index_lines(dist: str) -> list[str]:
    from importlib import resources

    text = resources.files("kvpatch.data").joinpath(f"commits-{dist}.txt").read_text()
    return [line for line in text.splitlines() if line and line[0] in "0123456789abcdef"]


def test_unknown_commit_falls_back_to_reproduction(run_py, tmp_path):
    dist = "mlx-vlm" if _has("mlx-vlm") else "mlx-lm"
    _require(dist)
    env = _overlay(tmp_path, dist, _git("0123456789abcdef0123456789abcdef01234567", "example/fork"))
    data = _status(run_py, env)
    mine = [p for p in data["patches"] if p["distribution"] == dist and p["fixed_commit"]]
    for p in mine:
        assert p["action"] == "verify", p
        assert "not on" in p["reason"] and "reproduction decides" in p["reason"]
    # and the patched import itself still works, with the reproduction deciding
    pkg = dist.replace("-", "_")
    run_py(f"import kvpatch, {pkg}.models.cache; print('ok')", env=env)


def test_corrupted_direct_url_is_reported_not_raised(run_py, tmp_path):
    dist = "mlx-lm" if _has("mlx-lm") else "mlx-vlm"
    _require(dist)
    env = _overlay(tmp_path, dist, "{this is not json")
    data = _status(run_py, env)
    assert data["upstream"][dist]["source"]["kind"] == "unknown"
    pkg = dist.replace("-", "_")
    out = run_py(f"import {pkg}.models.cache, kvpatch; print('imported')", env=env)
    assert "imported" in out


def _has(dist: str) -> bool:
    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


def test_registry_loads_cleanly():
    reg = registry.load()
    assert reg.broken == {}
    assert len(reg.patches) >= 1
