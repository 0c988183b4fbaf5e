"""The whole test suite on a GPU host in parts that each fit one call, and what the parts found together.

``scripts/gpu_run.sh`` runs it there (CONTRIBUTING.md, "GPU runs"); this module only plans and reads, with no mlx:

    python scripts/gpu_suite.py files K/N              # the test files of part K of N, one per line
    python scripts/gpu_suite.py summary DIR [DIR ...]   # the parts' results (suite-*.xml) merged
    python scripts/gpu_suite.py summary --durations DIR [DIR ...]   # ... and keep their times for the next split
    python scripts/gpu_suite.py compare GPU.json CPU.json             # two `status --verify --json`, per patch

The split is by test file (pytest-xdist's ``--dist loadfile`` keeps a file's tests in one worker), deterministic
and balanced by the seconds each file took in the last GPU run (``scripts/gpu_durations.json``, written by
``summary --durations``); a file not timed yet weighs what its test functions suggest. The summary counts
passed / failed / skipped across the parts, names the failures, groups the skip reasons, and names every planned
test file that no part reported (a part stopped at its time limit).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DURATIONS = REPO / "scripts" / "gpu_durations.json"
#: Seconds a file not timed yet is taken to need, per test function (tests/upstream files build models).
GUESS = {"upstream": 3.0, "other": 0.5}


def test_files() -> list[str]:
    """Every test file of the suite, as repo-relative POSIX paths, sorted."""
    return sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py"))


def _weights(files: list[str]) -> dict[str, float]:
    timed = json.loads(DURATIONS.read_text(encoding="utf-8")) if DURATIONS.is_file() else {}
    weights = {}
    for name in files:
        if isinstance(timed.get(name), (int, float)):
            weights[name] = float(timed[name])
        else:
            functions = (REPO / name).read_text(encoding="utf-8").count("\ndef test_") or 1
            weights[name] = functions * GUESS["upstream" if name.startswith("tests/upstream/") else "other"]
    return weights


def parts(n: int) -> list[list[str]]:
    """The files split into ``n`` parts of about equal time: longest first, each to the lightest part so far."""
    files = test_files()
    weights = _weights(files)
    load = [0.0] * n
    split: list[list[str]] = [[] for _ in range(n)]
    for name in sorted(files, key=lambda f: (-weights[f], f)):
        i = min(range(n), key=lambda k: (load[k], k))
        split[i].append(name)
        load[i] += weights[name]
    return [sorted(p) for p in split]


def _part(spec: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)/(\d+)", spec)
    if not match or not 1 <= int(match.group(1)) <= int(match.group(2)):
        raise SystemExit(f"a part is K/N with 1 <= K <= N, not {spec!r}")
    return int(match.group(1)), int(match.group(2))


def _file_of(case: ET.Element) -> str:
    """The test file of a junit ``testcase`` (``classname`` is the dotted module path, then any class)."""
    dotted = (case.get("classname") or case.get("name", "")).split(".")  # a module skipped whole: in ``name``
    for end in range(len(dotted), 0, -1):
        candidate = "/".join(dotted[:end]) + ".py"
        if (REPO / candidate).is_file():
            return candidate
    return case.get("file") or ".".join(dotted)


def _reason(skipped: ET.Element) -> str:
    """A skip reason without pytest's location prefix, so that equal reasons group (a module skipped at collection
    says why in its text: ``('path', line, 'Skipped: why')``)."""
    text = skipped.get("message") or ""
    if text == "collection skipped":
        found = re.search(r"Skipped: (.*?)['\"]\)\s*$", skipped.text or "", re.S)
        text = f"module skipped: {found.group(1)}" if found else text
    return re.sub(r"^.*?:\d+: ", "", text.strip()).strip()


def summary(dirs: list[Path], durations: bool) -> int:
    results = [(xml, ET.parse(xml).getroot()) for d in dirs for xml in sorted(d.glob("suite-*.xml"))]
    if not results:
        print(f"no suite-*.xml under {', '.join(map(str, dirs))}")
        return 1
    counts: Counter[str] = Counter()
    failures, skips, seen, per_file = [], Counter(), set(), Counter()
    planned: dict[str, str] = {}
    for xml, root in results:
        match = re.fullmatch(r"suite-(\d+)-of-(\d+)", xml.stem)
        if match:
            k, n = int(match.group(1)), int(match.group(2))
            planned |= {f: f"{k}/{n}" for f in parts(n)[k - 1]}
        for case in root.iter("testcase"):
            name = _file_of(case)
            seen.add(name)
            per_file[name] += float(case.get("time") or 0)
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome = "failed" if child.tag == "failure" else "errors"
                    first = (child.get("message") or "").splitlines()[0:1]
                    failures.append(f"{name}::{case.get('name')}: {first[0] if first else child.tag}")
                elif child.tag == "skipped":
                    outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
                    if outcome == "skipped":
                        skips[_reason(child)] += 1
            counts[outcome] += 1
    total = sum(counts.values())
    print(f"{len(results)} part(s): {total} tests: " + ", ".join(f"{counts[k]} {k}" for k in sorted(counts)))
    missing = sorted(f for f in planned if f not in seen)
    if missing:
        print(f"{len(missing)} planned test file(s) reported by no part (stopped at a time limit, or collected none):")
        print("\n".join(f"  {f} (part {planned[f]})" for f in missing))
    if failures:
        print(f"failed ({len(failures)}):")
        print("\n".join(f"  {f}" for f in failures))
    print(f"skipped ({sum(skips.values())}), by reason:")
    for reason, n in sorted(skips.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:>4}  {reason[:300]}")
    if durations:
        kept = json.loads(DURATIONS.read_text(encoding="utf-8")) if DURATIONS.is_file() else {}
        kept |= {f: round(t, 1) for f, t in per_file.items()}
        DURATIONS.write_text(json.dumps(dict(sorted(kept.items())), indent=1) + "\n", encoding="utf-8")
        print(f"kept the seconds of {len(per_file)} file(s) in {DURATIONS.relative_to(REPO)}")
    return 1 if failures or counts["errors"] or missing else 0


def compare(gpu: Path, cpu: Path) -> int:
    """Per patch, the ``--verify`` outcome on both sides; a difference that is not a device bug's fails."""

    def outcomes(path: Path) -> dict[str, str]:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text[text.index("{") :])  # a captured stdout may start with warnings
        return {e["id"]: (e["verify"] or {}).get("outcome") or e["state"] for e in data["patches"]}

    from kvpatch import registry  # the records say which bugs live in a device's kernels

    device = {p.id for p in registry.load().patches if p.on_device or p.metal_only}
    a, b = outcomes(gpu), outcomes(cpu)
    differ = 0
    for pid in sorted(a.keys() | b.keys()):
        same = a.get(pid) == b.get(pid)
        if not same:
            expected = pid in device
            differ += not expected
            why = "a device bug: measured where the user computes" if expected else "DIFFERENT"
            print(f"{pid}: GPU {a.get(pid)!r}, CPU {b.get(pid)!r} ({why})")
    print(f"{len(a.keys() | b.keys())} patches; {differ} verdict(s) differ beyond the device bugs")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    files = sub.add_parser("files", help="the test files of part K of N")
    files.add_argument("part", metavar="K/N")
    merged = sub.add_parser("summary", help="the parts' results merged")
    merged.add_argument("dirs", nargs="+", type=Path)
    merged.add_argument("--durations", action="store_true", help=f"keep the files' seconds in {DURATIONS.name}")
    both = sub.add_parser("compare", help="two `status --verify --json` outputs, per patch")
    both.add_argument("gpu", type=Path)
    both.add_argument("cpu", type=Path)
    args = parser.parse_args(argv)
    if args.command == "files":
        k, n = _part(args.part)
        print("\n".join(parts(n)[k - 1]))
        return 0
    if args.command == "summary":
        return summary(args.dirs, args.durations)
    return compare(args.gpu, args.cpu)


if __name__ == "__main__":
    sys.exit(main())
