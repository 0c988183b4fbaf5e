"""The installed bootstrap end to end, against the real upstream, each case in a fresh interpreter.

- ``-W error`` (or pytest's ``filterwarnings = error``) with a bad ``KVPATCH_DISABLE`` value: ``import
  mlx_lm`` works and every other fix is still applied (the bad id is warned about, never raised).
- A ``kvpatch.py`` and a ``wrapt.py`` in the working directory are not executed by ``import mlx_lm``,
  and the fixes are applied as from any other directory.

The reference is the same imports in a plain child. Run in the newest mlx-lm and mlx-vlm buckets only
(the bootstrap does not depend on the release), and everywhere else where upstream is installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from support import child_env

CHILD = r"""
import importlib, json, os, sys
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except ImportError:
        pass  # an optional target's module this release does not have
kv = sys.modules.get("kvpatch")  # never imported here: only what the bootstrap did counts
applied = sorted(s.patch.id for s in kv.records() if s.state.value == "applied") if kv else None
print(json.dumps({"active": kv is not None, "applied": applied}))
sys.stdout.flush()
os._exit(0)  # a process that imported mlx_vlm aborts at exit on some releases (upstream's)
"""


pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("_kvpatch_boot") is None, reason="kvpatch is not installed (no .pth)"),
]


def _modules() -> list[str]:
    from kvpatch import registry

    tops = [t for t in ("mlx_lm", "mlx_vlm") if importlib.util.find_spec(t) is not None]
    return [*tops, *sorted({m for p in registry.load().patches for m in p.modules if m.split(".")[0] in tops})]


def _child(cwd, *flags: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, *flags, "-c", CHILD, json.dumps(_modules())],
        cwd=cwd,
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, f"child printed nothing (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1]), proc.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    if not any(importlib.util.find_spec(t) for t in ("mlx_lm", "mlx_vlm")):
        pytest.skip("neither mlx-lm nor mlx-vlm is installed")
    out, err = _child(tmp_path_factory.mktemp("plain"))
    assert out["active"], err
    if not out["applied"]:
        pytest.skip("no patch applies to this upstream release")
    return out


def test_warning_error_keeps_the_other_fixes(tmp_path, reference):
    out, err = _child(tmp_path, "-W", "error", env={"KVPATCH_DISABLE": "mask-fil"})
    assert out["active"], err[-3000:]
    assert out["applied"] == reference["applied"], err[-3000:]


def test_warning_error_never_breaks_the_import(tmp_path, reference):
    _, err = _child(tmp_path, "-W", "error", env={"KVPATCH_DISABLE": "mask-fil"})
    assert "Traceback" not in err, err[-3000:]


def test_working_directory_files_are_not_executed(tmp_path, reference):
    for name in ("kvpatch", "wrapt"):
        (tmp_path / f"{name}.py").write_text(f"import sys\nsys.stderr.write('SHADOW {name} EXECUTED\\n')\n")
    out, err = _child(tmp_path)
    assert "SHADOW" not in err, err[-3000:]
    assert out["applied"] == reference["applied"], err[-3000:]
