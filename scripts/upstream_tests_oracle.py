"""Upstream's own tests as an oracle: kvpatch must never change their outcome.

For each mlx-lm release given (default: the oldest and the newest of the test matrix, 0.22.0 and
0.32.2), this takes upstream's tests from its sdist on PyPI (``pip download --no-binary :all:``;
cached under ``kvpatch.maint.envs.cache_dir()/upstream-tests/``), layers the release with the mlx (and
transformers) of its matrix bucket (``kvpatch/maint/matrix.py``) over this interpreter, and runs the model and
cache test files (:data:`FILES`) twice: once with ``KVPATCH=off`` and once with kvpatch active (a
``-p`` plugin imports kvpatch before any test module imports mlx-lm). The per-test outcomes must be
identical.

No test may download anything: ``HF_HUB_OFFLINE=1``, an empty ``HF_HOME``, sockets blocked. A test
class whose ``setUpClass`` loads a model from the Hugging Face hub gets stand-ins from the oracle's
plugin instead (any use of them raises), so the class's other tests still run; every test that needs
the network is reported as ``network`` (the same in both runs) and listed.

Usage: ``python scripts/upstream_tests_oracle.py [--release 0.22.0 --release 0.32.2] [--json]``.
Exit 0 when every release gives identical outcomes, 1 otherwise, 2 when a run could not be set up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]

from kvpatch.maint import envs  # noqa: E402
from kvpatch.maint.matrix import BY_NAME, LM_BUCKETS  # noqa: E402

#: The model and cache test files of mlx-lm's suite (those present in a release are run).
FILES = (
    "test_models.py",
    "test_prompt_cache.py",
    "test_deepseek_v41.py",
    "test_gated_delta.py",
    "test_muse_spark.py",
    "test_muse_spark_inputs.py",
)
DEFAULT_RELEASES = (LM_BUCKETS[0].version("mlx-lm"), LM_BUCKETS[-1].version("mlx-lm"))

PLUGIN = r'''
"""kvpatch's oracle plugin: record per-test outcomes, block the network, optionally activate kvpatch."""
import json
import os
import socket

if os.environ.get("KVPATCH_ORACLE_ACTIVE") == "1":
    import kvpatch  # noqa: F401  (activates it before any test module imports mlx-lm)

BLOCKED = "kvpatch-oracle: network access blocked"
NETWORK_MARKS = (BLOCKED, "needs a download from the hub", "OfflineModeIsEnabled", "LocalEntryNotFoundError",
                 "ModelNotFoundError", "HF_HUB_OFFLINE", "offline mode")


class NeedsNetwork(RuntimeError):
    pass


def _blocked(*args, **kwargs):
    raise NeedsNetwork(BLOCKED)


socket.socket.connect = _blocked
socket.socket.connect_ex = _blocked
socket.create_connection = _blocked


class _Hub:
    """Stands in for a model or tokenizer that would come from the hub: any use raises NeedsNetwork."""

    def __init__(self, path):
        object.__setattr__(self, "_path", path)

    def _fail(self, *args, **kwargs):
        raise NeedsNetwork(f"{object.__getattribute__(self, '_path')} needs a download from the hub")

    __call__ = __iter__ = __len__ = __getitem__ = __bool__ = _fail

    def __getattr__(self, name):
        self._fail()


def _offline_load(original):
    def load(path_or_hf_repo, *args, **kwargs):
        if os.path.exists(str(path_or_hf_repo)):
            return original(path_or_hf_repo, *args, **kwargs)
        return _Hub(path_or_hf_repo), _Hub(path_or_hf_repo)

    return load


def pytest_collection_modifyitems(session, config, items):
    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        load = getattr(module, "load", None)
        if callable(load) and getattr(load, "__module__", "") == "mlx_lm.utils" and load.__name__ == "load":
            module.load = _offline_load(load)


OUTCOMES = {}
RANK = {"passed": 0, "skipped": 1, "xfailed": 1, "xpassed": 2, "failed": 3, "error": 4, "network": 5}


def _key(report):
    ctx = getattr(report, "context", None)
    if ctx is None:
        return report.nodeid
    return f"{report.nodeid} [subtest {getattr(ctx, 'msg', None)!r} {getattr(ctx, 'kwargs', {})!r}]"


def pytest_runtest_logreport(report):
    if report.passed and report.when != "call":
        return
    if report.skipped:
        outcome = "xfailed" if hasattr(report, "wasxfail") else "skipped"
    elif report.failed:
        text = str(report.longrepr)
        if any(mark in text for mark in NETWORK_MARKS):
            outcome = "network"
        else:
            outcome = "failed" if report.when == "call" else "error"
    else:
        outcome = "xpassed" if hasattr(report, "wasxfail") else "passed"
    key = _key(report)
    if RANK[outcome] >= RANK.get(OUTCOMES.get(key, "passed"), 0) or key not in OUTCOMES:
        OUTCOMES[key] = outcome


def pytest_sessionfinish(session, exitstatus):
    applied = None
    if os.environ.get("KVPATCH_ORACLE_ACTIVE") == "1":
        import kvpatch

        applied = {pid: st.state.value for pid, st in kvpatch.get_engine().status.items()}
    with open(os.environ["KVPATCH_ORACLE_OUT"], "w") as fh:
        json.dump({"outcomes": OUTCOMES, "states": applied, "exit": int(exitstatus)}, fh)
'''


class SetupError(RuntimeError):
    pass


def upstream_tests(release: str) -> Path:
    """The directory holding mlx-lm ``release``'s ``tests/`` from its sdist (downloaded once)."""
    dest = envs.cache_dir() / "upstream-tests" / f"mlx-lm-{release}"
    if (dest / ".complete").is_file():
        return dest
    with tempfile.TemporaryDirectory(prefix="kvpatch-sdist-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", tmp]
        cmd += ["--cache-dir", str(envs.cache_dir() / "pip"), f"mlx-lm=={release}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=envs._clean_env())
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if proc.returncode != 0 or len(sdists) != 1:
            raise SetupError(f"pip download of the mlx-lm {release} sdist failed:\n{envs._tail(proc.stderr)}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-mlx-lm-{release}-", dir=dest.parent))
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers() if m.name.split("/")[1:2] == ["tests"] and (m.isfile() or m.isdir())]
            if not members:
                raise SetupError(f"the mlx-lm {release} sdist has no tests/ folder")
            for m in members:
                m.name = "/".join(m.name.split("/")[1:])
            tar.extractall(staging, members=members, filter="data")
    (staging / "pytest.ini").write_text("[pytest]\n")  # own rootdir, no inherited configuration
    (staging / ".complete").write_text(release + "\n")
    if dest.exists():
        import shutil

        shutil.rmtree(dest)
    staging.rename(dest)
    return dest


def run_once(release: str, root: Path, layers: list[Path], *, active: bool, timeout: float) -> dict[str, Any]:
    plugin_dir = envs.cache_dir() / "upstream-tests" / "plugin"
    plugin_dir.mkdir(parents=True, exist_ok=True)
    plugin = plugin_dir / "_kvpatch_oracle.py"
    if not plugin.is_file() or plugin.read_text() != PLUGIN:
        plugin.write_text(PLUGIN)
    files = [f"tests/{f}" for f in FILES if (root / "tests" / f).is_file()]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPATCH") or k == envs.CACHE_VAR}
    with tempfile.TemporaryDirectory(prefix="kvpatch-oracle-") as tmp:
        out = Path(tmp) / "outcomes.json"
        env.update(
            PYTHONPATH=os.pathsep.join([*map(str, layers), str(plugin_dir), str(REPO)]),
            HF_HOME=str(Path(tmp) / "hf"),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            KVPATCH_ORACLE_OUT=str(out),
            PYTHONDONTWRITEBYTECODE="1",
        )
        if active:
            env["KVPATCH_ORACLE_ACTIVE"] = "1"
        else:
            env["KVPATCH"] = "off"
        cmd = [sys.executable, "-m", "pytest", "-p", "_kvpatch_oracle", "-p", "no:cacheprovider", "-p", "no:kvpatch"]
        cmd += ["-q", "--rootdir", str(root), "-c", str(root / "pytest.ini"), *files]
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        seconds = time.monotonic() - started
        if proc.returncode not in (0, 1) or not out.is_file():
            raise SetupError(
                f"mlx-lm {release} ({'active' if active else 'KVPATCH=off'}): pytest exited {proc.returncode}:\n"
                + envs._tail(proc.stdout + proc.stderr, 30)
            )
        data = json.loads(out.read_text())
    data["seconds"] = seconds
    data["files"] = files
    return data


def check_release(release: str, *, timeout: float) -> dict[str, Any]:
    bucket = BY_NAME.get(f"lm-{release}")
    if bucket is None:
        raise SetupError(f"mlx-lm {release} is not a bucket of kvpatch/maint/matrix.py")
    started = time.monotonic()
    layers = envs.build(bucket)
    root = upstream_tests(release)
    setup = time.monotonic() - started
    off = run_once(release, root, layers, active=False, timeout=timeout)
    on = run_once(release, root, layers, active=True, timeout=timeout)
    keys = sorted(set(off["outcomes"]) | set(on["outcomes"]))
    diffs = [
        {"test": k, "off": off["outcomes"].get(k), "active": on["outcomes"].get(k)}
        for k in keys
        if off["outcomes"].get(k) != on["outcomes"].get(k)
    ]
    return {
        "release": release,
        "bucket": bucket.name,
        "layers": list(bucket.requirements),
        "files": off["files"],
        "off": dict(Counter(off["outcomes"].values())),
        "active": dict(Counter(on["outcomes"].values())),
        "applied": sorted(pid for pid, state in (on["states"] or {}).items() if state == "applied"),
        "network": sorted(k for k, v in off["outcomes"].items() if v == "network"),
        "differences": diffs,
        "identical": not diffs,
        "seconds": {"setup": round(setup, 1), "off": round(off["seconds"], 1), "active": round(on["seconds"], 1)},
    }


def _counts(c: dict[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(c.items(), key=lambda kv: -kv[1])) or "nothing"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--release", action="append", help="mlx-lm release (a matrix bucket); repeatable")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    args = parser.parse_args(argv)
    results = []
    for release in args.release or DEFAULT_RELEASES:
        try:
            results.append(check_release(release, timeout=args.timeout))
        except (SetupError, envs.EnvBuildError, subprocess.TimeoutExpired) as exc:
            results.append({"release": release, "error": str(exc), "identical": False})
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            if "error" in r:
                print(f"mlx-lm {r['release']}: could not run: {r['error']}")
                continue
            n = sum(r["off"].values())
            print(f"mlx-lm {r['release']} ({', '.join(r['layers'])}): {n} tests in {', '.join(r['files'])}")
            print(f"  KVPATCH=off:    {_counts(r['off'])}  ({r['seconds']['off']} s)")
            print(f"  kvpatch active: {_counts(r['active'])}  ({r['seconds']['active']} s)")
            print(f"  applied in the active run: {', '.join(r['applied']) or 'none'}")
            if r["network"]:
                print(f"  need the network (not run for real, same in both runs): {len(r['network'])}")
                for k in r["network"]:
                    print(f"    {k}")
            if r["identical"]:
                print("  outcomes identical")
            else:
                print(f"  OUTCOMES DIFFER ({len(r['differences'])}):")
                for d in r["differences"]:
                    print(f"    {d['test']}: KVPATCH=off {d['off']} -> kvpatch active {d['active']}")
    if any("error" in r for r in results):
        return 2
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
