"""Issue 11, item 6: Rapid-MLX 0.16.10 ships ``rapid_mlx/models/mlx_vlm_vendored/cache.py``, a copy of
mlx-vlm 0.7.2's cache module. ``kvpatch status --scan`` reports the copies of patched targets in it;
``KVPATCH_VENDORED=1`` patches them with the same fix (offset-detach's effect shows on the copy's
``BatchKVCache``: the lazy offset graph stays flat); ``deactivate()`` puts the copy's code back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from coexist_support import needs, run_scenario
from support import child_env

MODULE = "rapid_mlx.models.mlx_vlm_vendored.cache"
EXPECTED = {  # (patch, copy) pairs the scan must find on mlx-vlm 0.7.2 / mlx-lm 0.31.3
    ("offset-detach-vlm", f"{MODULE}.BatchKVCache.update_and_fetch"),
    ("offset-detach-vlm", f"{MODULE}.BatchQuantizedKVCache.update_and_fetch"),
    ("vlm-batch-extend-dtype", f"{MODULE}.BatchKVCache.extend"),
    ("vlm-batch-extend-dtype", f"{MODULE}.BatchRotatingKVCache.extend"),
}


def test_status_scan_reports_rapid_mlx_vendored_copies():
    needs("rapid-mlx")
    proc = subprocess.run(
        [sys.executable, "-m", "kvpatch", "status", "--scan", "--json"],
        env=child_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    found = {(c["patch"], c["copy"]) for c in data["vendored"]}
    assert EXPECTED <= found, sorted(found)
    assert all(c["state"].startswith("found") for c in data["vendored"]), data["vendored"]  # a CLI patches nothing
    assert not any(m.startswith("mlx_lm") or m.startswith("mlx_vlm") for m in json.loads(_imported())), (
        "scan imported upstream"
    )
    text = subprocess.run(
        [sys.executable, "-m", "kvpatch", "status", "--scan"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    ).stdout
    assert f"{MODULE}.BatchKVCache.update_and_fetch" in text and "vendored copies:" in text, text


def _imported() -> str:
    code = (
        "import json, sys, kvpatch\n"
        "from kvpatch import vendored\n"
        "vendored.scan(kvpatch.get_engine(), installed=True)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('mlx_lm', 'mlx_vlm', 'rapid_mlx')))))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, check=True
    ).stdout


@pytest.mark.parametrize("order", ["kvpatch-first", "server-first"])
def test_vendored_copies_patched_only_when_opted_in(order):
    needs("rapid-mlx")
    off = run_scenario("vendored", order=order)
    assert off["edges"]["60"] > off["edges"]["10"], f"the copy's offset graph should grow unpatched: {off}"
    assert all(state.startswith("found") for state in off["copies"].values()), off
    assert EXPECTED <= {tuple(key.split(" ")) for key in off["copies"]}, off

    on = run_scenario("vendored", order=order, env={"KVPATCH_VENDORED": "1"})
    for patch_id, path in EXPECTED:
        assert on["copies"][f"{patch_id} {path}"] == "patched", on
    assert on["edges"]["60"] == on["edges"]["10"], f"offset-detach's fix did not reach the copy: {on}"
    assert "kvpatch" in on["function"], on  # the code that runs is kvpatch's delta
    assert on["restored"].endswith("rapid_mlx/models/mlx_vlm_vendored/cache.py"), on  # deactivate() put it back
    assert all(state.startswith("found") for state in on["after"].values()), on
