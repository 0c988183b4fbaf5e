"""Auto-activation through the installed ``kvpatch.pth`` bootstrap, in fresh interpreters.

These need kvpatch *installed* (the .pth lives in site-packages); from a bare source checkout they
are skipped. Upstream is not needed: the bootstrap's trigger is the import of a package named
``mlx_lm`` / ``mlx_vlm``, which the test provides as an empty stand-in package only to watch the
trigger fire (no patch logic is exercised against it; the real upstream runs in tests/upstream).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("_kvpatch_boot") is None, reason="kvpatch is not installed (no .pth bootstrap)"
)

PROBE = "import sys, json; {body}; print(json.dumps({{'kvpatch': 'kvpatch' in sys.modules, 'wrapt': 'wrapt' in sys.modules}}))"


def _trigger_dir(tmp_path):
    pkg = tmp_path / "trigger" / "mlx_lm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    return str(tmp_path / "trigger")


def test_plain_process_pays_nothing(run_py):
    out = json.loads(run_py(PROBE.format(body="pass")))
    assert out == {"kvpatch": False, "wrapt": False}


def test_importing_upstream_activates(run_py, tmp_path):
    out = json.loads(run_py(PROBE.format(body="import mlx_lm"), env={"PYTHONPATH": _trigger_dir(tmp_path)}))
    assert out["kvpatch"] is True


def test_kvpatch_off_disables_bootstrap(run_py, tmp_path):
    env = {"PYTHONPATH": _trigger_dir(tmp_path), "KVPATCH": "off"}
    out = json.loads(run_py(PROBE.format(body="import mlx_lm"), env=env))
    assert out["kvpatch"] is False


def test_run_subcommand(run_py, tmp_path):
    mod = tmp_path / "trigger2"
    mod.mkdir()
    (mod / "kvpatch_demo_main.py").write_text("import sys; print('argv', sys.argv[1:], 'kvpatch' in sys.modules)")
    out = run_py(
        "import runpy, sys; sys.argv=['kvpatch','run','-m','kvpatch_demo_main','--x','1']; runpy.run_module('kvpatch', run_name='__main__')",
        env={"PYTHONPATH": str(mod)},
    )
    assert "argv ['--x', '1'] True" in out
