"""Helpers shared by the test modules (a plain module: ``from conftest import`` is ambiguous, since
tests/upstream has a conftest of its own)."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: Matrix results for the closing summary (tests/conftest.py): bucket name -> (exit code, its pytest summary line).
MATRIX_RESULTS = pytest.StashKey[dict]()
#: How a matrix bucket's closing lines give its CPU time (the pytest process and its children, user and system).
CPU_LINE = "bucket cpu time:"
#: How many buckets were selected (KVPATCH_MATRIX), for the same summary.
MATRIX_SELECTED = pytest.StashKey[int]()


_VERDICTS: str | None = None


def verdicts_dir() -> str:
    """A verdict cache for this test session (kvpatch.verdicts): tests never read or write the environment's."""
    global _VERDICTS
    if _VERDICTS is None:
        _VERDICTS = os.environ.get("KVPATCH_VERDICTS")
        if not _VERDICTS:
            _VERDICTS = tempfile.mkdtemp(prefix="kvpatch-test-verdicts-")
            # the process that made it removes it (children and matrix buckets inherit it through the env)
            atexit.register(shutil.rmtree, _VERDICTS, ignore_errors=True)
    return _VERDICTS


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process: no KVPATCH switches of the caller, the session's verdict cache, and no
    background verification (a test that wants one asks for it with ``KVPATCH_VERIFY=auto``)."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("KVPATCH") or k in ("KVPATCH_CACHE", "KVPATCH_BUCKET")
    }
    env["KVPATCH_VERDICTS"] = verdicts_dir()
    env["KVPATCH_VERIFY"] = "never"
    env.update(extra or {})
    return env


def arrays_state_difference(model, arrays_cache: type, batch: list[list[int]], left_padding, lengths, row: int, alone):
    """The largest difference (:func:`kvpatch.testing.difference`, the worst) between row ``row``'s recurrent state
    after a padded batch prefill and ``alone``'s state prefilled by itself (every ``arrays_cache`` of ``model``'s
    cache, every array it holds)."""
    import mlx.core as mx

    from kvpatch.testing import difference, worst

    def prefill(tokens, left_padding, lengths):
        cache = model.make_cache()
        for c in cache:
            if isinstance(c, arrays_cache):
                if left_padding is not None:
                    c.left_padding = mx.array(left_padding)
                if lengths is not None:
                    c.prepare(lengths=lengths)
        model(mx.array(tokens), cache=cache)
        return [c for c in cache if isinstance(c, arrays_cache)]

    batched = prefill(batch, left_padding, lengths)
    single = prefill([alone], None, None)
    return worst(
        difference(b[row], a[0], where=f"state {i}")
        for cb, ca in zip(batched, single, strict=True)
        for i, (b, a) in enumerate(zip(cb.cache, ca.cache, strict=True))
    )


def synthetic_patch(
    pid: str,
    *,
    affected: str = ">=0.22.0,<0.24.0",
    fixed_in: str | None = "0.24.0",
    checked: str | None = None,
    target: tuple[str, str] = ("mlx_lm.models.base", "fake_target"),
    **fields,
):
    """A record no registry holds (for gate, status and problem-finder tests): one replace target whose builder
    returns the original, and a reproduction that finds nothing."""
    from kvpatch.record import Expiry, Finding, Patch

    p = Patch(
        id=pid,
        summary="synthetic",
        distribution="mlx-lm",
        affected=affected,
        fixed_in=fixed_in,
        checked_through=checked,
        reference="not reported upstream",
        expiry=Expiry("test"),
        **fields,
    )
    p.replace(*target)(lambda original: original)
    p.reproduce(lambda: Finding(False))
    return p


#: How pip says it could not reach a package index at all (name resolution, no route, refused, proxy), as opposed
#: to an index that answered without the release.
_NO_INDEX_MARKS = (
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "No route to host",
    "Connection refused",
    "ProxyError",
)


def in_ci() -> bool:
    """True where the environment variable ``CI`` is set (to anything but empty, 0 or false): CI has a package
    index, so there a build that cannot reach one is a failure, never a skip."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def skip_if_no_index(error: str, what: str) -> None:
    """Skip the test when ``error`` (an ``EnvBuildError``'s text, or pip's output) says that pip could not reach a
    package index (an offline host, e.g. the GPU machine, with the layer not cached); do nothing otherwise (the
    caller fails), and nothing under CI."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    network = next((line for line in lines if any(mark in line for mark in _NO_INDEX_MARKS)), None)
    if in_ci() or network is None:
        return
    said = dict.fromkeys([lines[0], network, *(line for line in lines[1:] if line.startswith("ERROR:"))])
    pytest.skip(f"{what} needs a package index and none is reachable here: " + " | ".join(said))


def fake_mlx_core(site) -> None:
    """Write, under ``site``, the little of ``mlx.core`` that ``run_reproduction`` touches (it keeps the default
    device, stream and random state, and runs a logic bug's reproduction on the CPU stream), for engine tests that
    run a reproduction without mlx."""
    (site / "mlx").mkdir()
    (site / "mlx" / "__init__.py").write_text("")
    (site / "mlx" / "core.py").write_text(
        "import contextlib, types\nrandom = types.SimpleNamespace(state=[0])\ncpu, gpu = 'cpu', 'gpu'\n"
        "def default_device(): return 'cpu'\ndef default_stream(device): return 's'\n"
        "def set_default_device(device): pass\ndef set_default_stream(stream): pass\n"
        "def stream(s): return contextlib.nullcontext()\ndef is_available(device): return device == cpu\n"
    )


#: Python code defining ``patch(pid, affected, symptom="buggy", **record_fields)``: a patch of the fake upstream's
#: ``mlx_lm.models.cache.C.f`` (:func:`fake_upstream`) that makes it say "fixed", whose reproduction finds the bug where
#: ``C().f()`` says ``symptom``. ``BUILDS`` counts its builds; ``INSIDE_IMPORTS`` says, for each run of a
#: reproduction, whether it ran inside an import statement.
DEMO_PATCH = """
import inspect, json, sys
from kvpatch.config import Config
from kvpatch.engine import Engine
from kvpatch.record import Expiry, Finding, Patch
BUILDS, INSIDE_IMPORTS = [], []

def patch(pid, affected, symptom="buggy", **kw):
    p = Patch(id=pid, summary="demo", distribution="mlx-lm", affected=affected, reference="none",
              expiry=Expiry("never"), **kw)
    p.module = "kvpatch"

    @p.replace("mlx_lm.models.cache", "C.f")
    def build(original):
        BUILDS.append(1)
        def f(self):
            return "fixed"
        return f

    @p.reproduce
    def reproduce():
        INSIDE_IMPORTS.append(any("importlib._bootstrap" in f.filename for f in inspect.stack()))
        import mlx_lm.models.cache as c
        return Finding(c.C().f() == symptom, "f() said " + c.C().f())
    return p
"""


def fake_upstream(tmp_path: Path, version: str) -> str:
    """A site folder under ``tmp_path`` with a small mlx-lm ``version`` (one class, ``mlx_lm.models.cache.C``, whose
    ``f()`` says "buggy"), a vendored copy of that module (``copied_cache``) and the little of mlx.core a reproduction
    run touches; the ``PYTHONPATH`` that puts it first."""
    site = tmp_path / "site"
    (site / "mlx_lm" / "models").mkdir(parents=True)
    (site / "mlx_lm" / "__init__.py").write_text("")
    (site / "mlx_lm" / "models" / "__init__.py").write_text("")
    for module in (site / "mlx_lm" / "models" / "cache.py", site / "copied_cache.py"):
        module.write_text("class C:\n    def f(self):\n        return 'buggy'\n")
    fake_mlx_core(site)
    info = site / f"mlx_lm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: mlx-lm\nVersion: {version}\n")
    return os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])


def run_child(code: str, tmp_path: Path, **env: str) -> dict:
    """Run ``code`` (dedented) in a fresh interpreter from ``tmp_path`` with :func:`child_env` and ``env``; the JSON of
    the line it prints after ``@@``."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=child_env(env),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("@@"))[2:])
