"""A server's whole test suite three ways, by hand (issue 29's closing note): not a test, a tool.

Run inside the server's coexist bucket, from an environment that has pytest-timeout (and pytest-asyncio for
Rapid-MLX, whose tests are async) beside kvpatch, e.g. a throwaway venv with ``pip install . pytest
pytest-timeout pytest-asyncio``::

    nice -n 19 .venv/bin/python scripts/in_bucket.py coexist-vllm-mlx -- \\
        python tests/coexist/whole_suites.py vllm-mlx --out /tmp/whole-vllm

The ways: ``a`` the server's fixes on, ``KVPATCH=off``; ``b`` the server's fixes that kvpatch replaces switched
off (``server_fixes.off_environ``), kvpatch on; ``c`` both on. The suite's test files run in chunks, each chunk
all three ways before the next, so a run stopped early still compares the same tests three ways. Each test has
a time limit (pytest-timeout, ``--timeout``); a chunk that outlives ``--chunk-timeout`` (a hang the per-test
limit cannot interrupt) is killed, the test it was in is recorded as ``hung`` and the chunk runs again without
it. Outcomes go to ``OUT/<way>.json`` after every chunk; ``--table`` prints the counts of what has finished.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from coexist_support import installed  # noqa: E402
from downstream import _outcomes, overlapping_files, pytest_command, sdist_tree  # noqa: E402
from server_fixes import off_environ  # noqa: E402
from support import child_env  # noqa: E402

WAYS = {
    "a": "server fixes on, KVPATCH=off",
    "b": "server fixes off, kvpatch on",
    "c": "both on",
}
#: Per-server pytest options the suite's own config (not in the sdist) would give: Rapid-MLX's pytest.ini sets
#: ``asyncio_mode = auto``.
SERVER_OPTIONS = {"rapid-mlx": ["-o", "asyncio_mode=auto"], "vllm-mlx": []}


#: No test may reach the hub: offline, a suite's download fixtures fail at once instead of waiting on the network
#: (vllm-mlx's test_streaming_detokenizer hangs past any per-test limit otherwise).
OFFLINE = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _environ(way: str) -> dict[str, str]:
    if way == "a":
        return child_env({"KVPATCH": "off", **OFFLINE})
    if way == "b":
        return off_environ(child_env(OFFLINE))
    return child_env(OFFLINE)


def _last_started(log: Path) -> str | None:
    """The node id of the last test pytest -v started and did not finish."""
    last = None
    for line in log.read_text(errors="replace").splitlines():
        head = line.split(" ", 1)[0]
        if "::" in head and head.startswith("tests/"):
            last = head if not line.rstrip().endswith("%]") else None
    return last


def run_chunk(tree: Path, files: list[str], way: str, args: argparse.Namespace, server: str) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    deselect: list[str] = []
    for _attempt in range(5):
        with tempfile.TemporaryDirectory(prefix="kvpatch-whole-") as tmp:
            xml, log = Path(tmp) / "junit.xml", Path(tmp) / "log"
            cmd = [
                *pytest_command(files, xml), "-v", f"--timeout={args.timeout}", "--timeout-method=signal",
                *SERVER_OPTIONS[server], *[f"--deselect={d}" for d in deselect],
            ]  # fmt: skip
            with log.open("w") as fh:
                proc = subprocess.Popen(cmd, cwd=tree, env=_environ(way), stdout=fh, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip
                try:
                    proc.wait(timeout=args.chunk_timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    hung = _last_started(log)
                    print(f"  [{way}] chunk killed after {args.chunk_timeout}s in {hung}", flush=True)
                    if hung is None or hung in deselect:
                        for f in files:
                            outcomes[f"{f}::(chunk killed)"] = "hung"
                        return outcomes
                    outcomes[hung] = "hung"
                    deselect.append(hung)
                    continue
            if xml.is_file():
                outcomes.update(_outcomes(xml))
            else:
                for f in files:
                    outcomes[f"{f}::(no report, rc {proc.returncode})"] = "error"
            return outcomes
    return outcomes


def _load(out: Path, way: str) -> dict[str, str]:
    path = out / f"{way}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _module(test: str) -> str:
    """The test file's module of a junit test id (``tests.test_x.TestY::name``, or ``::tests.test_x`` for a file that
    did not collect): only finished files are counted, every way of them."""
    classname, _, name = test.partition("::")
    parts = (classname or name).split(".")
    return ".".join(parts[:2])


def table(outs: list[Path]) -> None:
    done = {f for out in outs if (out / "done.json").is_file() for f in json.loads((out / "done.json").read_text())}
    print(f"{len(done)} files done")
    modules = {f.removesuffix(".py").replace("/", ".") for f in done}
    results: dict[str, dict[str, str]] = {way: {} for way in WAYS}
    for out in outs:
        for way in WAYS:
            results[way].update((t, o) for t, o in _load(out, way).items() if _module(t) in modules)
    for way, what in WAYS.items():
        counts: dict[str, int] = {}
        for outcome in results[way].values():
            counts[outcome] = counts.get(outcome, 0) + 1
        print(
            f"  {way} ({what}): {len(results[way])} tests: " + ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
        )
    names = sorted(set().union(*results.values()))
    for name in names:
        row = [results[way].get(name, "-") for way in WAYS]
        if len(set(row)) > 1:
            print(f"  differs {name}: " + " / ".join(row))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("server", choices=sorted(SERVER_OPTIONS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--chunk", type=int, default=6, help="test files per chunk")
    parser.add_argument("--timeout", type=int, default=180, help="seconds per test (pytest-timeout)")
    parser.add_argument("--chunk-timeout", type=int, default=600, help="seconds per chunk and way")
    parser.add_argument("--overlap-first", action="store_true", help="the cache-related files first")
    parser.add_argument("--file", action="append", default=[], help="run only these test files (repeatable)")
    parser.add_argument("--reverse", action="store_true", help="the files in reverse order (a second runner)")
    parser.add_argument("--table", action="store_true", help="print the counts so far and exit")
    parser.add_argument("--also", type=Path, action="append", default=[], help="with --table: another run's OUT")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.table:
        table([args.out, *args.also])
        return 0
    tree = sdist_tree(args.server, installed(args.server) or "")
    files = sorted(str(p.relative_to(tree)) for p in (tree / "tests").rglob("test_*.py"))
    if args.file:
        files = [f for f in files if f in args.file]
    if args.overlap_first:
        first = overlapping_files(tree)
        files = first + [f for f in files if f not in first]
    done_path = args.out / "done.json"
    done = json.loads(done_path.read_text()) if done_path.is_file() else []
    todo = [f for f in (reversed(files) if args.reverse else files) if f not in done]
    print(f"{args.server}: {len(files)} files, {len(todo)} to run", flush=True)
    for start in range(0, len(todo), args.chunk):
        chunk = todo[start : start + args.chunk]
        for way in WAYS:
            results = _load(args.out, way)
            results.update(run_chunk(tree, chunk, way, args, args.server))
            (args.out / f"{way}.json").write_text(json.dumps(results, indent=0, sort_keys=True))
        done += chunk
        done_path.write_text(json.dumps(done))
        print(f"{len(done)}/{len(files)} files", flush=True)
    table([args.out])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
