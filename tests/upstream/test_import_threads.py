"""First imports of mlx_lm and mlx_vlm from 8 threads at once, through the installed bootstrap.

Each run is a fresh interpreter whose 8 threads start together (a barrier) and import the registry's
target modules and both top-level packages, each thread in a different order (so a package and its
submodules are first imported concurrently, the case where a finder that imports while the import
system holds its lock hangs for good). Then the main thread imports the same modules (to finish
whatever a thread left), and the patch states, and which targets hold kvpatch's replacement in the
modules now in ``sys.modules``, are compared with a run that imported the same modules from one
thread: every patch applied there must be applied here, every time, and no thread may hang.

Upstream's own races are kept out of the verdict: transformers is imported first (it raises
ImportError when first imported from several threads at once); imports that fail in a thread are
counted, not judged (with ``KVPATCH=off`` too, CPython < 3.15 raises ``_DeadlockError`` when a package
and its submodules are first imported from several threads, and mlx_lm's circular imports raise
ImportError); and the child prints its result and leaves with ``os._exit(0)`` (a process that
imported mlx_vlm in a thread aborts at exit, rc 134, with kvpatch off too).

Runs: ``KVPATCH_THREAD_RUNS`` (default 10; 100 for the closing measurement). In the matrix it runs in
the newest mlx-lm and the newest mlx-vlm bucket only (it costs about 10 s a run), everywhere else
where upstream is installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from support import child_env

THREADS = 8
RUNS = int(os.environ.get("KVPATCH_THREAD_RUNS", "10"))
HANG_S = 240

CHILD = r"""
import faulthandler, importlib, json, os, sys, threading, time
MODULES = json.loads(sys.argv[1])
THREADS = int(sys.argv[2])
# A watchdog thread of faulthandler's own, which needs no GIL: stacks of every thread, then exit 3.
faulthandler.dump_traceback_later(float(sys.argv[3]) + 60, exit=True)
try:
    import transformers  # noqa: F401  (upstream's own race: it must not be first imported from threads)
except Exception:
    pass
barrier = threading.Barrier(max(THREADS, 1))
errors = []

def work(order, together=False):
    if together:
        barrier.wait()
    for name in order:
        try:
            importlib.import_module(name)
        except Exception as exc:
            errors.append(f"{name}: {type(exc).__name__}: {exc}")

orders = [MODULES[i % len(MODULES):] + MODULES[:i % len(MODULES)] for i in range(THREADS)]
if THREADS:
    threads = [threading.Thread(target=work, args=(o, True), daemon=True) for o in orders]
    for t in threads:
        t.start()
    deadline = time.monotonic() + float(sys.argv[3])
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = sum(t.is_alive() for t in threads)
    if hung:
        faulthandler.dump_traceback(all_threads=True)
        print(json.dumps({"hung": hung, "errors": errors}))
        sys.stdout.flush()
        os._exit(0)
    first = list(errors)
else:
    first = []
work(MODULES)  # the main thread finishes whatever a thread could not import
booted = "kvpatch" in sys.modules
import inspect
import kvpatch
PATCHES = os.path.join(os.path.dirname(kvpatch.__file__), "patches")

def live(target):
    # Is kvpatch's replacement what the module in sys.modules holds now? (a replacement's code lives in
    # kvpatch/patches, whatever metadata it copied from the original)
    owner = sys.modules.get(target.module)
    for part in target.qualname.split(".")[:-1]:
        owner = getattr(owner, part, None)
    try:
        value = inspect.getattr_static(owner, target.qualname.split(".")[-1])
    except AttributeError:
        return False
    if isinstance(value, property):  # a replaced property: its fixed setter (or getter) is kvpatch's code
        value = value.fset or value.fget
    code = getattr(getattr(value, "__func__", value), "__code__", None)
    return code is not None and code.co_filename.startswith(PATCHES)

records = kvpatch.records()
states = {st.patch.id: st.state.value for st in records}
patched = {st.patch.id: sorted(t.path for t in st.patch.targets if live(t)) for st in records}
print(json.dumps({"hung": 0, "errors": first, "booted": booted, "states": states, "live": patched}))
sys.stdout.flush()
os._exit(0)
"""


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("_kvpatch_boot") is None, reason="kvpatch is not installed (no .pth)"),
]


def _modules() -> list[str]:
    from kvpatch import registry

    tops = [t for t in ("mlx_lm", "mlx_vlm") if importlib.util.find_spec(t) is not None]
    targets = sorted({m for p in registry.load().patches for m in p.modules if m.split(".")[0] in tops})
    return [*tops, *targets]


def _child(modules: list[str], threads: int, tmp_path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(modules), str(threads), str(HANG_S)],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=HANG_S + 300,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, f"child printed nothing (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    out = json.loads(lines[-1])
    out["stderr"] = proc.stderr
    return out


def test_first_imports_from_8_threads_apply_every_patch(tmp_path):
    modules = _modules()
    if not modules:
        pytest.skip("neither mlx-lm nor mlx-vlm is installed")
    reference = _child(modules, 0, tmp_path)
    assert reference["booted"], "the bootstrap did not activate kvpatch on a plain import"
    expected = reference["states"]
    applied = sorted(pid for pid, state in expected.items() if state == "applied")
    if not applied:
        pytest.skip("no patch applies to this upstream release")
    assert "pending" not in expected.values(), expected
    assert all(reference["live"][pid] for pid in applied), reference["live"]
    failures = []
    thread_errors = 0
    for run in range(RUNS):
        out = _child(modules, THREADS, tmp_path)
        if out["hung"]:
            failures.append(f"run {run}: {out['hung']} threads hung\n{out['stderr'][-6000:]}")
            break  # a hang is the finding: its stacks are above
        thread_errors += len(out["errors"])
        for what in ("states", "live"):
            if out[what] != reference[what]:
                diff = {k: (v, out[what].get(k)) for k, v in reference[what].items() if out[what].get(k) != v}
                failures.append(f"run {run}: {what} differ from a one-thread import (expected, got): {diff}")
    assert not failures, "\n".join(failures)
    # Failed imports in threads are upstream's (CPython before 3.15 locks a package after its submodule,
    # and mlx_lm's modules import each other in circles): they happen with KVPATCH=off too.
    print(
        f"{RUNS} runs x {THREADS} threads: {len(applied)} patches applied (and live in sys.modules) every time: "
        f"{', '.join(applied)}; {thread_errors} imports failed in threads (upstream's races)"
    )
