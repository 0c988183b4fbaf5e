"""The runtime never imports maintainer tooling or test helpers.

In a child process of the bucket: import kvpatch, settle ``status``, then ``status --verify`` (every relevant
patch's reproduction without and with its patch) and ``kvpatch verify`` (every patch considered, opt-in ones
too): afterwards no ``kvpatch.maint`` module and no ``kvpatch.testing`` is in ``sys.modules``.
"""

from __future__ import annotations

import json

CHILD = r"""
import argparse, contextlib, io, json, sys
import kvpatch
from kvpatch import cli, status

engine = kvpatch.get_engine()
status.build_report(engine)
status.build_report(engine, verify=True)
with contextlib.redirect_stdout(io.StringIO()):
    cli.cmd_verify(argparse.Namespace(background=None, json=True, missing=False))
loaded = sorted(m for m in sys.modules if m.startswith(("kvpatch.maint", "kvpatch.testing")))
print("@@" + json.dumps(loaded))
"""


def test_runtime_imports_no_maintainer_tooling(run_py, tmp_path):
    env = {"KVPATCH_VERDICTS": str(tmp_path / "verdicts"), "KVPATCH_CACHE": str(tmp_path / "cache")}
    stdout = run_py(CHILD, env=env)
    line = next(line for line in stdout.splitlines() if line.startswith("@@"))
    assert json.loads(line[2:]) == []
