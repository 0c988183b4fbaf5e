"""``importlib.reload`` of a patched upstream module (Jupyter's autoreload) re-executes its code: new classes
and functions, without kvpatch's replacements. ``records()`` (and so ``require_applied`` and ``status``) must
not call such a patch applied while the live code is unpatched: the engine sees the re-executed module and
installs the patch again, so the bug's reproduction is fixed again."""

from __future__ import annotations

import json

import pytest

CHILD = r"""
import importlib, json, sys
import kvpatch
from kvpatch.engine import run_reproduction

engine = kvpatch.get_engine()
module = sys.argv[1]
importlib.import_module(module)
applied = [r.patch for r in kvpatch.records()
           if r.state.value == "applied" and module in r.patch.modules and not r.patch.metal_only]
importlib.reload(sys.modules[module])
states = {r.patch.id: r.state.value for r in kvpatch.records()}
out = {}
for patch in applied:
    finding = run_reproduction(patch)
    out[patch.id] = [states[patch.id], finding.bug.value if hasattr(finding, "bug") else finding.verdict]
print("@@" + json.dumps(out))
"""


@pytest.mark.parametrize("module", ["mlx_lm.models.cache", "mlx_vlm.models.cache"])
def test_reload_is_patched_again(module, run_py, tmp_path):
    pytest.importorskip(module.split(".")[0])
    env = {"KVPATCH_VERDICTS": str(tmp_path / "verdicts"), "KVPATCH_CACHE": str(tmp_path / "cache")}
    stdout = run_py(CHILD.replace("sys.argv[1]", repr(module)), env=env)
    out = json.loads(next(line for line in stdout.splitlines() if line.startswith("@@"))[2:])
    if not out:
        pytest.skip(f"no patch applies to {module} in this release")
    # "applied" is the truth after the reload: the reproduction finds no bug (skipped: another backend's bug)
    lies = {pid: v for pid, v in out.items() if v[0] == "applied" and v[1] not in ("absent", "skipped")}
    assert not lies, lies
    assert all(v[0] == "applied" for v in out.values()), out
