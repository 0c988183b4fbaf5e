#!/usr/bin/env python3
"""Record the source fingerprint of every replaced target on every release of its patch's affected range.

Writes ``kvpatch/data/fingerprints.json`` (schema ``kvpatch.fingerprints/1``)::

    {"schema": ..., "patches": {"<patch id>": {"<target path>": {"<fingerprint>": ["0.28.0", ..., "git:1a2b3c4d"]}}}}

The engine reads it once (``kvpatch.fingerprints.validated``) and compares each replaced target's
fingerprint (``kvpatch.fingerprints.fingerprint``: the target's source, blank lines, comments and indentation
normalised) with the recorded ones: a target whose code is none of them has *drifted* (an editable
install, a vendor's patched wheel, a file rewritten in place) and the patch goes to its verdict
instead of being applied blindly.

Releases: every final, non-yanked release of the patch's distribution on the package index inside
``affected`` (``kvpatch.maint.upstream_check.index_releases``). Each is layered with ``kvpatch.maint.envs.layer``
(``pip install --no-deps --target``, cached under ``~/.cache/kvpatch``) together with the mlx (and, for
mlx-vlm, the mlx-lm and extra layers) of the nearest matrix bucket (``tests/matrix.py``), and a child
process with ``KVPATCH=off`` imports the target modules and fingerprints the real objects, exactly as
the engine does. Where a module cannot be imported with those layers, the fingerprint is computed
from the layer's source file (the same text ``inspect.getsource`` returns, found with ``ast``); the two
methods are compared on every release where both work, and the script stops if they ever disagree.

Git pins: with ``--git`` (default when the mirrors exist: ``/work/.mirror/<owner>+<name>/repo``),
every main-line commit of the commit index (``kvpatch/data/commits-*.txt``) between the first
affected release's tag and the fixing commit (or the index's head for an unfixed bug) that changed a
target's file is fingerprinted from the file as of that commit (the ``ast`` method). Fingerprints seen
only on commits are recorded as ``git:<commit prefix>`` (the first commit that has them), so a pin
between releases is not taken for drift.

Usage::

    .venv/bin/python scripts/record_fingerprints.py [--only ID,ID] [--no-git] [--check]

``--check`` exits 1 when the file would change (nothing is written). Needs the package index (PyPI).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from matrix import BUCKETS  # noqa: E402

from kvpatch.fingerprints import fingerprint_source  # noqa: E402
from kvpatch.maint import envs  # noqa: E402
from kvpatch.maint.envs import Bucket  # noqa: E402
from kvpatch.maint.sources import definition, module_file  # noqa: E402
from kvpatch.record import DISTRIBUTIONS, Kind, Patch  # noqa: E402
from kvpatch.registry import load  # noqa: E402

OUT = REPO / "kvpatch" / "data" / "fingerprints.json"
SCHEMA = "kvpatch.fingerprints/1"
MIRRORS = {
    "mlx-lm": Path("/work/.mirror/ml-explore+mlx-lm/repo"),
    "mlx-vlm": Path("/work/.mirror/Blaizzy+mlx-vlm/repo"),
}
_MARK = "@@fp@@"


def ast_fingerprint(source: str, qualname: str) -> str | None:
    """The fingerprint of ``qualname`` defined in ``source`` (methods looked up through same-module bases)."""
    node = definition(source, qualname)
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    end = node.end_lineno or node.lineno
    return fingerprint_source("\n".join(source.splitlines()[first - 1 : end]))


# ------------------------------------------------------------------------------------------------
# Releases and their layers


def releases_in(patch: Patch, available: list[Version]) -> list[str]:
    return [str(v) for v in available if patch.range.contains(v, prereleases=False)]


def index_versions(distribution: str) -> list[Version]:
    from kvpatch.maint.upstream_check import index_releases

    out = []
    for r in index_releases(distribution)[0]:
        try:
            v = Version(r.version)
        except InvalidVersion:
            continue
        if not (v.is_prerelease or v.is_devrelease):
            out.append(v)
    return sorted(set(out))


def bucket_for(distribution: str, release: str) -> Bucket:
    """The nearest matrix bucket's layers with ``release`` of ``distribution`` in place of its own."""
    prefix = "lm-" if distribution == "mlx-lm" else "vlm-"
    mine = sorted(
        (Version(b.version(distribution) or "0"), b)
        for b in BUCKETS
        if b.name.startswith(prefix) and b.version(distribution)
    )
    target = Version(release)
    below = [b for v, b in mine if v <= target]
    nearest = below[-1] if below else mine[0][1]
    pins = tuple(
        f"{distribution}=={release}" if p.split("==")[0].split("[")[0] == distribution else p for p in nearest.pins
    )
    return Bucket(f"{prefix}{release}", pins, nearest.extra)


_CHILD = r"""
import importlib, inspect, json, sys
from kvpatch.fingerprints import fingerprint
targets = json.loads(sys.argv[1])
out = {}
for path, module, qualname in targets:
    try:
        owner = importlib.import_module(module)
        parts = qualname.split(".")
        for part in parts[:-1]:
            owner = getattr(owner, part)
        static = inspect.getattr_static(owner, parts[-1])
    except AttributeError:
        out[path] = {"absent": True}
        continue
    except Exception as exc:
        out[path] = {"error": f"{type(exc).__name__}: {exc}"}
        continue
    obj = getattr(static, "__func__", static)
    code = getattr(inspect.unwrap(obj), "__code__", None)
    out[path] = {"fp": fingerprint(obj), "file": getattr(code, "co_filename", None)}
print("@@fp@@" + json.dumps(out))
"""


def measure_release(distribution: str, release: str, targets: list[tuple[str, str, str]]) -> dict[str, dict[str, Any]]:
    bucket = bucket_for(distribution, release)
    layers = envs.build(bucket)
    env = envs.bucket_environ(bucket, base={k: v for k, v in os.environ.items() if not k.startswith("KVPATCH")})
    env["KVPATCH"] = "off"
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(targets)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=envs.cache_dir(),
    )
    result: dict[str, dict[str, Any]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            result = json.loads(line[len(_MARK) :])
    if not result:
        tail = envs._tail(proc.stderr, 6)
        result = {path: {"error": f"child exited {proc.returncode}: {tail}"} for path, _, _ in targets}
    # The same targets from the layer's source text: cross-check, and fallback where the import failed.
    root = layers[next(i for i, p in enumerate(bucket.pins) if p.startswith(distribution + "=="))]
    for path, module, qualname in targets:
        file = module_file(root, module)
        by_ast = ast_fingerprint(file.read_text(encoding="utf-8"), qualname) if file else None
        entry = result.setdefault(path, {})
        entry["ast"] = by_ast
    return result


# ------------------------------------------------------------------------------------------------
# Git pins


def _git(mirror: Path, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(mirror), *args], capture_output=True, text=True, check=True).stdout


def mainline(distribution: str) -> list[str]:
    text = (REPO / "kvpatch" / "data" / f"commits-{distribution}.txt").read_text()
    return [line.split()[0] for line in text.splitlines() if line and line[0] in "0123456789abcdef"]


def tag_commit(mirror: Path, release: str) -> str | None:
    for tag in (f"v{release}", release):
        try:
            return _git(mirror, "rev-list", "-n", "1", tag).strip()
        except subprocess.CalledProcessError:
            continue
    return None


def git_fingerprints(patch: Patch, first_release: str, known: dict[str, dict[str, list[str]]]) -> dict[str, int]:
    """Add ``git:<commit>`` labels for fingerprints seen on main-line commits only. Returns counts per target."""
    mirror = MIRRORS.get(patch.distribution)
    if mirror is None or not mirror.exists():
        return {}
    line = mainline(patch.distribution)
    position = {c: i for i, c in enumerate(line)}
    start = tag_commit(mirror, first_release)
    head = line[-1]
    # the tagged commit may sit on a release branch: take its merge base with the main line; a release older
    # than the indexed history (mlx-lm moved out of mlx-examples at 0.22/0.23): start at the oldest indexed commit
    base = _git(mirror, "merge-base", start, head).strip() if start else line[0]
    lo = position.get(base, 0)
    end = head
    if patch.fixed_commit:
        full = [c for c in line if c.startswith(patch.fixed_commit)]
        if not full:
            return {}
        end = full[0]
    hi = position.get(end)
    if lo is None or hi is None or hi < lo:
        return {}
    window = line[lo : hi + (0 if patch.fixed_commit else 1)]  # the fixing commit itself has the fix
    counts: dict[str, int] = {}
    package = DISTRIBUTIONS[patch.distribution]
    for target in patch.targets:
        if target.kind is not Kind.REPLACE:
            continue
        rel = "/".join(target.module.split(".")) + ".py"
        alt = "/".join(target.module.split(".")) + "/__init__.py"
        assert rel.startswith(package)
        fps = known.setdefault(target.path, {})
        seen_fp: set[str] = set()
        # a target's code changes only where its file does: the window's first commit and the first-parent
        # commits inside it that changed the file
        members = set(window)
        changed = _git(mirror, "log", "--first-parent", "--format=%H", f"{window[0]}..{window[-1]}", "--", rel, alt)
        commits = [window[0], *(c for c in reversed(changed.split()) if c in members)]
        for commit in commits:
            source = None
            for candidate in (rel, alt):
                try:
                    source = _git(mirror, "show", f"{commit}:{candidate}")
                    break
                except subprocess.CalledProcessError:
                    continue
            if source is None:
                continue
            fp = ast_fingerprint(source, target.qualname)
            if fp is None or fp in seen_fp:
                continue
            seen_fp.add(fp)
            if fp not in fps:
                fps[fp] = [f"git:{commit[:8]}"]
        counts[target.path] = len(seen_fp)
    return counts


# ------------------------------------------------------------------------------------------------


def render(data: dict[str, Any]) -> str:
    """JSON with one line per fingerprint (its releases on that line), so that diffs stay readable."""
    out = ["{", f' "schema": {json.dumps(data["schema"])},', ' "patches": {']
    patches = list(data["patches"].items())
    for i, (pid, targets) in enumerate(patches):
        out.append(f"  {json.dumps(pid)}: {{")
        for j, (path, fps) in enumerate(targets.items()):
            out.append(f"   {json.dumps(path)}: {{")
            for k, (fp, labels) in enumerate(fps.items()):
                comma = "," if k < len(fps) - 1 else ""
                out.append(f"    {json.dumps(fp)}: {json.dumps(labels)}{comma}")
            out.append("   }" + ("," if j < len(targets) - 1 else ""))
        out.append("  }" + ("," if i < len(patches) - 1 else ""))
    out += [" }", "}"]
    return "\n".join(out) + "\n"


def known_versions(distribution: str, recorded: dict[str, Any]) -> list[Version]:
    """Without the package index (``--offline``): the releases the matrix runs, those with a cached layer and those
    ``fingerprints.json`` already names. A release none of them knows is not measured (the plan says so)."""
    from kvpatch.maint.matrix import TESTED

    labels = {
        label
        for entry in recorded.values()
        for fps in entry.values()
        for labels in fps.values()
        for label in labels
        if not label.startswith("git:")
    }
    found = {*TESTED.get(distribution, ()), *envs.cached_versions(distribution)}
    return sorted({Version(v) for v in found | labels if not Version(v).is_prerelease})


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.0f} MB" if size >= 1e6 else f"{size / 1e3:.0f} kB"


def plan(wanted: dict[tuple[str, str], Any], *, offline: bool) -> set[tuple[str, str]]:
    """Say which releases will be measured and which layers that downloads (roughly how much), before doing it.
    Returns the releases that cannot be measured: with ``offline``, those whose layers are not all cached."""
    if not wanted:
        print("fingerprints: no release to measure", file=sys.stderr)
        return set()
    by_dist: dict[str, list[str]] = defaultdict(list)
    for dist, release in sorted(wanted, key=lambda k: (k[0], Version(k[1]))):
        by_dist[dist].append(release)
    releases = "; ".join(f"{dist} {', '.join(rels)}" for dist, rels in by_dist.items())
    print(f"fingerprints: measuring {len(wanted)} releases ({releases})", file=sys.stderr)
    needs = {key: bucket_for(*key).requirements for key in wanted}
    missing, size, unknown = envs.missing_layers(req for reqs in needs.values() for req in reqs)
    if not missing:
        print("fingerprints: every layer they need is cached: nothing to download", file=sys.stderr)
        return set()
    amount = f"about {_megabytes(size)}" + (f" plus {', '.join(unknown)} (size unknown)" if unknown else "")
    layers = f"{len(missing)} layers not cached ({', '.join(missing)}; {amount} under {envs.cache_dir() / 'layers'})"
    if not offline:
        print(
            f"fingerprints: downloading and installing {layers}; --offline measures the cached ones only",
            file=sys.stderr,
        )
        return set()
    absent = {key for key, reqs in needs.items() if set(reqs) & set(missing)}
    skipped = ", ".join(f"{dist} {release}" for dist, release in sorted(absent))
    print(f"fingerprints: offline: {layers}, so {skipped} are not measured: run without --offline", file=sys.stderr)
    return absent


def _label_order(label: str) -> tuple[bool, Version]:
    return (label.startswith("git:"), Version("0") if label.startswith("git:") else Version(label))


def _keep(table: dict[str, Any], old: dict[str, Any], pid: str, keep: Any) -> None:
    """Carry ``old``'s labels of patch ``pid`` for which ``keep(label)`` holds into ``table``; a commit's label only
    where no release has that fingerprint (as :func:`git_fingerprints` records them)."""
    for path, fps in old.get(pid, {}).items():
        mine = table.setdefault(pid, {}).setdefault(path, {})
        for fp, labels in fps.items():
            for label in labels:
                released = any(not x.startswith("git:") for x in mine.get(fp, []))
                if keep(label) and not (label.startswith("git:") and released) and label not in mine.get(fp, []):
                    mine.setdefault(fp, []).append(label)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated patch ids (others are kept as they are)")
    parser.add_argument("--no-git", action="store_true", help="do not fingerprint git commits (keep the recorded ones)")
    parser.add_argument("--check", action="store_true", help="exit 1 when the file would change; write nothing")
    parser.add_argument(
        "--offline",
        action="store_true",
        help="ask no package index and download nothing: measure the releases whose layers are cached, name the rest",
    )
    parser.add_argument(
        "--git-only", action="store_true", help="keep the recorded releases; only (re)add the git commits' fingerprints"
    )
    args = parser.parse_args(argv)

    reg = load()
    by_id = {p.id: p for p in reg.patches}
    only = {i.strip() for i in args.only.split(",") if i.strip()}
    unknown_ids = sorted(only - set(by_id))
    if unknown_ids:
        print(f"--only names no patch: {', '.join(unknown_ids)} (`kvpatch list` shows the ids)", file=sys.stderr)
        return 2
    patches = [p for p in reg.patches if (not only or p.id in only) and any(t.kind is Kind.REPLACE for t in p.targets)]
    old = json.loads(OUT.read_text()) if OUT.exists() else {"schema": SCHEMA, "patches": {}}
    recorded: dict[str, Any] = old.get("patches", {})
    table: dict[str, dict[str, dict[str, list[str]]]] = {
        pid: entry for pid, entry in recorded.items() if pid in by_id and pid not in {p.id for p in patches}
    }

    dists = {p.distribution for p in (patches or reg.patches)}
    versions = {d: known_versions(d, recorded) if args.offline else index_versions(d) for d in dists}
    if args.offline:
        print(
            "fingerprints: offline: the releases are the matrix's, the cached layers' and fingerprints.json's "
            "(no package index is asked)",
            file=sys.stderr,
        )
    wanted: dict[tuple[str, str], list[tuple[Patch, Any]]] = defaultdict(list)
    if args.git_only:
        table = {pid: e for pid, e in recorded.items() if pid in by_id}
        table = {
            pid: {
                t: {fp: [x for x in labels if not x.startswith("git:")] for fp, labels in fps.items()}
                for t, fps in e.items()
            }
            for pid, e in table.items()
        }
        table = {pid: {t: {fp: x for fp, x in fps.items() if x} for t, fps in e.items()} for pid, e in table.items()}
        patches = []
    for p in patches:
        for release in releases_in(p, versions[p.distribution]):
            for t in p.targets:
                if t.kind is Kind.REPLACE:
                    wanted[(p.distribution, release)].append((p, t))
    unmeasured = plan(wanted, offline=args.offline)
    disagreements: list[str] = []
    failures: list[str] = []
    methods: dict[str, int] = defaultdict(int)
    for (dist, release), items in sorted(wanted.items(), key=lambda kv: (kv[0][0], Version(kv[0][1]))):
        if (dist, release) in unmeasured:
            continue
        targets = sorted({(t.path, t.module, t.qualname) for _, t in items})
        print(f"{dist} {release}: {len(targets)} targets", file=sys.stderr, flush=True)
        try:
            measured = measure_release(dist, release, targets)
        except Exception as exc:
            failures.append(f"{dist} {release}: {type(exc).__name__}: {exc}")
            continue
        for p, t in items:
            m = measured.get(t.path, {})
            if m.get("absent"):
                methods["absent"] += 1
                continue
            fp = m.get("fp")
            if fp and m.get("ast") and m["ast"] != fp:
                disagreements.append(f"{dist} {release} {t.path}: import {fp}, ast {m['ast']} ({m.get('file')})")
            if fp:
                methods["import"] += 1
            elif m.get("ast"):
                fp = m["ast"]
                methods["ast"] += 1
            else:
                if not t.optional:
                    failures.append(f"{p.id} {dist} {release} {t.path}: {m.get('error') or 'no fingerprint'}")
                continue
            table.setdefault(p.id, {}).setdefault(t.path, {}).setdefault(fp, [])
            if release not in table[p.id][t.path][fp]:
                table[p.id][t.path][fp].append(release)
    for p in patches:  # offline: the releases not measured keep what was recorded for them
        _keep(table, recorded, p.id, lambda label, d=p.distribution: (d, label) in unmeasured)
    git_counts: dict[str, dict[str, int]] = {}
    for p in patches or [by_id[pid] for pid in table]:
        mirror = MIRRORS.get(p.distribution)
        if args.no_git or args.offline or mirror is None or not mirror.exists():
            # no git history to read: the commits' fingerprints recorded so far stay as they are
            _keep(table, recorded, p.id, lambda label: label.startswith("git:"))
            continue
        rels = releases_in(p, versions[p.distribution])
        if rels:
            git_counts[p.id] = git_fingerprints(p, rels[0], table.setdefault(p.id, {}))
    for entry in table.values():
        for path, fps in entry.items():
            for labels in fps.values():
                labels.sort(key=_label_order)
            # the order a measurement over ascending releases finds them in, whichever were measured now
            entry[path] = dict(sorted(fps.items(), key=lambda item: _label_order(item[1][0])))
    table = {pid: {t: fps for t, fps in e.items() if fps} for pid, e in table.items()}
    data = {"schema": SCHEMA, "patches": {pid: table[pid] for pid in sorted(table) if table[pid]}}
    text = render(data)
    print(
        f"methods: {dict(methods)}; import/ast disagreements: {len(disagreements)}; failures: {len(failures)}; "
        f"git fingerprints per target: {git_counts}",
        file=sys.stderr,
    )
    for line in disagreements + failures:
        print(f"  {line}", file=sys.stderr)
    if disagreements:
        print("the ast method disagrees with the engine's fingerprint: fix ast_fingerprint first", file=sys.stderr)
        return 1
    name = OUT.relative_to(REPO)
    left = f"; not measured (not cached, --offline): {', '.join(f'{d} {r}' for d, r in sorted(unmeasured))}"
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            now = json.loads(text)["patches"]
            differ = sorted(pid for pid in set(now) | set(recorded) if now.get(pid) != recorded.get(pid))
            print(f"{name} is stale for: {', '.join(differ)}", file=sys.stderr)
            return 1
        print(f"{name}: up to date" + (left if unmeasured else ""), file=sys.stderr)
        return 0
    OUT.write_text(text)
    print(f"wrote {name}" + (left + ": their recorded fingerprints are kept" if unmeasured else ""), file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
