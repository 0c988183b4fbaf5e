"""``python -m kvpatch.maint.hunt.report DIR... [--write docs/findings.md]``: the findings page's tables, from the
JSON the hunt writes (``--out``), so that they are regenerated from runs, never typed.

Three tables, each between ``<!-- hunt:NAME -->`` and ``<!-- /hunt:NAME -->`` in docs/findings.md:

``buckets``       every hunt read: bucket, releases, levels and hunts, budget, seconds, architectures the model level
                  ran (built and ran alone) of those it reached, findings by verdict, and how many findings of the
                  kvpatch-on hunt are attributed to a patch (a patch that does not fix what it claims: none expected);
``rediscovered``  every cache- or model-level patch of the catalogue (:func:`reachable`): the invariant that found it
                  with kvpatch off, where, and its shortest reproduction; or why it was not;
``new``           the findings attributed ``new``, one row per bug (:func:`bug_of`), each with the releases it was
                  found on and its documented gap (:mod:`.gaps`: the page's own gaps table) or "undocumented".
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from packaging.version import Version

from ...record import Patch
from . import gaps
from .attribute import fixed_by

#: The findings page, in a checkout (the report is a maintainer tool: it runs from one).
PAGE = Path("docs/findings.md")

#: Modules whose code the hunt drives: the caches and the models (their attention functions included).
REACHED = re.compile(r"mlx_(lm|vlm)\.models\.|mlx_vlm\.turboquant$")


def reachable(patch: Patch) -> bool:
    """A cache- or model-level patch: every target in a cache or model module, computed on the CPU (not a kernel of
    one backend: ``on_device`` / ``metal_only``) and not a policy (``opt_in``). The rest (generation, servers,
    kernels) is out of the hunt's reach by design (docs/findings.md)."""
    return (
        all(REACHED.match(t.module) for t in patch.targets)
        and not (patch.on_device or patch.metal_only or patch.opt_in)
        and bool(patch.targets)
    )


def load(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Every hunt result (schema ``kvpatch.hunt/1``) under ``paths`` (files or folders, searched recursively)."""
    out = []
    for path in paths:
        files = sorted(path.rglob("*.json")) if path.is_dir() else [path]
        for file in files:
            data = json.loads(file.read_text(encoding="utf-8"))
            if data.get("schema") == "kvpatch.hunt/1" and "bucket" in data:
                out.append(data)
    return out


def verdict(f: dict[str, Any]) -> str:
    return str(f.get("attribution", {}).get("verdict", "not attributed"))


def release(result: dict[str, Any], patch: Patch | None = None) -> str:
    """The release a result speaks for: the patch's distribution's, or the bucket's newest package."""
    releases = result["releases"]
    dist = patch.distribution if patch is not None else ("mlx-vlm" if "mlx-vlm" in releases else "mlx-lm")
    return f"{dist} {releases.get(dist)}"


def _in_range(patch: Patch, result: dict[str, Any]) -> bool:
    version = result["releases"].get(patch.distribution)
    return version is not None and patch.range.contains(Version(version), prereleases=True)


def bug_of(f: dict[str, Any]) -> tuple[str, ...]:
    """One bug across buckets: the package and class or architecture, the invariant, the operation (decode and update
    are one), and for a crash its exception and message shape."""
    signature = list(f["signature"])[:5]
    if signature[2] == "decode":
        signature[2] = "update"
    package, name = signature[0].split(".")[0], signature[0].split(".")[-1]
    return (f"{package} {name}", *signature[1:])


def from_the_hunt(patch: Patch) -> bool:
    """A patch made from one of the hunt's own findings (its catalogue entry says so): found by construction, so the
    share of the catalogue the hunt rediscovers is also given without them."""
    return "bug hunt" in patch.catalogue


def rediscovered(results: list[dict[str, Any]], patches: Sequence[Patch]) -> tuple[list[list[str]], int, int]:
    """The rediscovery table's rows, and (rediscovered, reachable) counts."""
    rows, hit, total = [], 0, 0
    for patch in patches:
        if not reachable(patch):
            continue
        total += 1
        found = [
            (f["length"], f, r)
            for r in results
            for f in r["findings"]
            if patch.id in fixed_by(verdict(f)) and "off" in f["hunts"]
        ]
        if found:
            hit += 1
            length, f, r = min(found, key=lambda x: (x[0], x[2]["bucket"]))
            where = sorted({x[2]["bucket"] for x in found}, key=_bucket_key)
            others = [p for p in fixed_by(verdict(f)) if p != patch.id]
            rows.append(
                [
                    patch.id,
                    f["invariant"] + (f" (so does {', '.join(others)}, each alone)" if others else ""),
                    f"{release(r, patch)} ({f['target'].split('.')[-1]}, {f['operation']})",
                    str(length),
                    ", ".join(where),
                ]
            )
        else:
            rows.append([patch.id, "not rediscovered: " + _why_not(patch, results), "", "", ""])
    return rows, hit, total


def _why_not(patch: Patch, results: list[dict[str, Any]]) -> str:
    hunted = [r for r in results if _in_range(patch, r)]
    if not hunted:
        return f"no bucket of its range ({patch.affected}) hunted"
    classes = {".".join((t.module, t.owner_path[0])) for t in patch.targets if t.owner_path}
    skipped: dict[str, str] = {}
    for r in hunted:
        for info in r["hunts"].values():
            skipped.update({k: v for k, v in info.get("not_hunted", {}).items() if k in classes})
    several = [
        r["bucket"]
        for r in hunted
        for f in r["findings"]
        if "off" in f["hunts"] and verdict(f).startswith("fixed by kvpatch (") and patch.id in verdict(f)
    ]
    if several:
        return f"found, but brought back only by several patches disabled together ({', '.join(sorted(set(several)))})"
    if skipped and len(skipped) == len(classes):
        return "its classes are not hunted: " + "; ".join(f"{k.split('.')[-1]}: {v}" for k, v in skipped.items())
    budgets = sorted({f"{r['bucket']} {r['budget']:g} s" for r in hunted}, key=_bucket_key)
    return f"not found in {len(hunted)} hunts of its range ({', '.join(budgets)})"


def new_findings(results: list[dict[str, Any]], documented: list[gaps.Gap]) -> list[list[str]]:
    """One row per new bug: bug, invariant, buckets, shortest reproduction, status (its documented gap's reason)."""
    bugs: dict[tuple[str, ...], list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for r in results:
        for f in r["findings"]:
            if verdict(f) == "new":
                bugs.setdefault(bug_of(f), []).append((f, r))
    # a bug that a later hunt of the same bucket attributes to a patch (one added since): patched there
    patched: dict[tuple[str, tuple[str, ...]], set[str]] = {}
    for r in results:
        for f in r["findings"]:
            if fixed_by(verdict(f)):
                patched.setdefault((r["bucket"], bug_of(f)), set()).update(fixed_by(verdict(f)))
    rows = []
    for key, seen in sorted(bugs.items()):
        f, r = min(seen, key=lambda x: x[0]["length"])
        where = sorted({r["bucket"] for _, r in seen}, key=_bucket_key)
        crash = f" ({key[3]}: {key[4]})" if key[4] else f" ({key[3]})" if key[3] else ""
        fixes = sorted({p for _, r in seen for p in patched.get((r["bucket"], key), ())})
        rest = [(f, r) for f, r in seen if (r["bucket"], key) not in patched]
        # documented only when every bucket it was found in is within a gap's releases (one row per release range);
        # the why of a documented gap is its reason's "Not patched" part (the whole reason is in the gaps table)
        found = [gaps.match(f, documented, r["releases"]) for f, r in rest]
        reasons = list(dict.fromkeys(g for g in found if g is not None))
        gap = None if None in found else " / ".join(g[max(g.find("Not patched"), 0) :] for g in reasons)
        status = "undocumented" if gap is None else f"documented gap: {gap}"
        if fixes:
            on = ", ".join(sorted({r["bucket"] for _, r in seen if (r["bucket"], key) in patched}, key=_bucket_key))
            patch = f"patched: {', '.join(fixes)} (a later hunt of {on} attributes it)"
            status = patch if not rest else f"{patch}; elsewhere {status}"
        rows.append([f"{key[0]}: {key[1]} after {key[2]}{crash}", ", ".join(where), str(f["length"]), status])
    return rows


def bucket_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in sorted(results, key=lambda r: (_bucket_key(r["bucket"]), r["budget"])):
        counts: dict[str, int] = {}
        for f in r["findings"]:
            v = verdict(f)
            v = "fixed by a patch" if v.startswith("fixed by") else v.split(":")[0]
            counts[v] = counts.get(v, 0) + 1
        releases = ", ".join(f"{d} {v}" for d, v in r["releases"].items())
        shown = ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))
        # what kvpatch on still shows of a bug a patch claims (the hunt's exit status counts it too): none expected
        on = sum(1 for f in r["findings"] if "on" in f["hunts"] and fixed_by(verdict(f)))
        seconds = f"{r['seconds']['total']:g}"
        # the model level's reach: architectures whose tiny config built and ran alone, of those it reached
        first: dict[str, Any] = next(iter(r["hunts"].values()), {})
        archs: dict[str, Any] = first.get("architectures", {})
        covered = sum(1 for a in archs.values() if a.get("covered"))
        reach = f"{covered} of {len(archs)}" if "model" in r.get("levels", ()) else "-"
        levels = ",".join(r.get("levels", ())) + (f" ({r['only']})" if r.get("only") else "")
        hunts = "/".join(r["hunts"])
        rows.append(
            [r["bucket"], releases, f"{levels}; {hunts}", f"{r['budget']:g}", seconds, reach, shown or "none", str(on)]
        )
    return rows


def _bucket_key(text: str) -> tuple[Any, ...]:
    name = text.split()[0]
    kind, _, version = name.partition("-")
    try:
        return (kind, Version(version), text)
    except ValueError:
        return (kind, Version("0"), text)


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def sections(results: list[dict[str, Any]], patches: Sequence[Patch], documented: list[gaps.Gap]) -> dict[str, str]:
    """The page's generated sections by name."""
    rows, hit, total = rediscovered(results, patches)
    lengths = [f["length"] for r in results for f in r["findings"]]
    median = statistics.median(lengths) if lengths else 0
    share = f"{hit} of {total} ({hit / total:.0%})" if total else "none"
    own = {p.id for p in patches if from_the_hunt(p) and reachable(p)}
    before = [r for r in rows if r[0] not in own]
    found_before = sum(1 for r in before if not r[1].startswith("not rediscovered"))
    without = (
        f" Without the {len(own)} patches made from the hunt's own findings: **{found_before} of {len(before)} "
        f"({found_before / len(before):.0%})**."
        if own and before
        else ""
    )
    new_rows = new_findings(results, documented)
    return {
        "buckets": table(
            (
                "bucket",
                "releases",
                "levels; kvpatch",
                "budget (s)",
                "seconds",
                "architectures run",
                "findings by verdict",
                "kvpatch on: a patched bug",
            ),
            bucket_rows(results),
        ),
        "rediscovered": (
            f"Rediscovered with kvpatch off: **{share}** of the catalogue's cache- and model-level patches "
            "(`report.reachable`: every target in a cache or model module, computed on the CPU, not an opt-in "
            f"policy).{without} Median reproduction over all {len(lengths)} findings: **{median:g} lines**.\n\n"
            + table(("patch", "invariant that found it", "release (class, operation)", "lines", "buckets"), rows)
        ),
        "new": table(("finding", "buckets", "lines", "status"), new_rows) if new_rows else "None.",
    }


def write(page: Path, generated: dict[str, str]) -> None:
    """Replace each ``<!-- hunt:NAME -->`` ... ``<!-- /hunt:NAME -->`` block of ``page``, each mark on a line of its
    own (the page's prose may name them); a begin mark without its end gets one after the new body."""
    text = page.read_text(encoding="utf-8")
    for name, body in generated.items():
        begin = re.search(rf"^<!-- hunt:{name} -->$", text, flags=re.M)
        if begin is None:
            raise SystemExit(f"{page}: no <!-- hunt:{name} --> on a line of its own")
        end = re.compile(rf"^<!-- /hunt:{name} -->$", flags=re.M).search(text, begin.end())
        tail = text[end.end() :] if end is not None else text[begin.end() :]
        text = f"{text[: begin.end()]}\n{body}\n<!-- /hunt:{name} -->{tail}"
    page.write_text(text, encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    from ...registry import load as registry

    parser = argparse.ArgumentParser(prog="python -m kvpatch.maint.hunt.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="hunt JSON files or folders (the hunt's --out)")
    parser.add_argument("--write", type=Path, help="replace the generated sections of this page")
    parser.add_argument("--gaps", type=Path, default=PAGE, help="the page whose gaps table to read (%(default)s)")
    args = parser.parse_args(argv)
    generated = sections(load(args.paths), registry().patches, gaps.read(args.gaps))
    if args.write:
        write(args.write, generated)
    else:
        for name, body in generated.items():
            print(f"<!-- hunt:{name} -->\n{body}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
