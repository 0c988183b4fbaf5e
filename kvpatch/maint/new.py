"""A new patch unit, and whether a unit is finished.

    python -m kvpatch.maint.new ID --package mlx-lm --affected ">=A,<=B" --target mlx_lm.models.cache.KVCache.trim \\
        --summary "what goes wrong, in one line" --catalogue "issue 37 item 2" [--reference owner/repo#N] [...]

writes the unit where the layout rule puts it (:func:`kvpatch.registry.module_for`): a Broken / Upstream / Fix
docstring, the ``PATCH = Patch(...)`` record from the options, one builder per target (a plain function with the
target's own signature, read from the release's source, that calls the original) and a reproduction stub; its test,
``tests/upstream/test_<id>.py``, with the ``requires_patch`` marker; and its CHANGELOG.md line. Then it runs
``python -m kvpatch.maint.regenerate --only ID``, so the files derived from the units (the unit index, the
fingerprints, COMPAT.md) already count the new patch. What is left to write is marked :data:`STUB`; :func:`unfinished`
lists each such line, and tests/engine/test_new_units.py fails on them in the unit tier, so the quick tier names what
is still missing.

Record facts are options, not stubs: they feed the derived files, so changing one later means regenerating again.
"""

from __future__ import annotations

import argparse
import ast
import datetime as _dt
import importlib
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from kvpatch import registry
from kvpatch.record import DISTRIBUTIONS, Expiry, Patch, RecordError

from . import envs
from .matrix import BUCKETS, TESTED
from .sources import definition, module_file

__all__ = [
    "STUB",
    "main",
    "record_problems",
    "render_test",
    "render_unit",
    "test_path",
    "unfinished",
    "with_changelog_entry",
]

#: Marks what the contributor still has to write, in the unit and its test.
STUB = "TODO(scaffold)"
#: The clone's root (this module is ``kvpatch/maint/new.py`` in it).
REPO = Path(__file__).resolve().parents[2]
WIDTH = 120  # ruff's line length (pyproject.toml)
#: How long an unfixed patch goes before its review-by date (kvpatch/maint/expiry.py) asks for another look.
REVIEW_AFTER = _dt.timedelta(days=182)


# -- what a unit still lacks ---------------------------------------------------------------------------------------


def record_problems(patch: Patch) -> list[str]:
    """What the maintainer checks refuse in ``patch``'s record, one line per field, saying what to set. (The record
    itself refuses what would make the gate wrong; these are what the derived files and the audit would show blank.)"""
    out = []
    if not patch.catalogue.strip():
        out.append(
            "catalogue is empty: set catalogue= to the bug's id in kvpatch's catalogue (e.g. 'C4') or to the tracker "
            "issue that reported it ('issue 37 item 2'); COMPAT.md and `kvpatch status --json` show it"
        )
    if not patch.summary.strip():
        out.append("summary is empty: set summary= to what goes wrong, in one line (status and COMPAT.md show it)")
    if not patch.reference.strip():
        out.append(
            "reference is empty: set reference= to upstream's pull request 'owner/repo#N', or 'not reported upstream'"
        )
    return out


def test_path(patch_id: str, root: Path | None = None) -> Path:
    """The patch's own test file (CONTRIBUTING.md, "Adding a patch") in the clone at ``root`` (default: this one)."""
    return (root or REPO) / "tests" / "upstream" / f"test_{patch_id.replace('-', '_')}.py"


def unit_path(patch_id: str, distribution: str, root: Path | None = None) -> Path:
    return (root or REPO).joinpath(*registry.module_for(patch_id, distribution).split(".")).with_suffix(".py")


def unfinished(root: Path | None = None) -> list[str]:
    """Every :data:`STUB` line left in the patch units and the patches' tests of the clone at ``root`` (default: this
    one), as ``path:line: what to write``."""
    root = root or REPO
    files = sorted((root / "kvpatch" / "patches").rglob("*.py")) + sorted(
        (root / "tests" / "upstream").glob("test_*.py")
    )
    out = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if STUB in line:
                what = line.split(STUB, 1)[1].lstrip(":) ").rstrip("\"')")
                out.append(f"{path.relative_to(root)}:{number}: {what}")
    return out


# -- the unit and its test -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetSpec:
    module: str
    qualname: str
    #: ``(parameters, call arguments)`` of the original, read from the release's source; None: not read.
    signature: tuple[str, str] | None = None

    @property
    def attribute(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _string(key: str, text: str, indent: int) -> list[str]:
    """``key=<text>,`` (``<text>,`` for no key) in one line, or as implicitly concatenated parts in parentheses where
    it would not fit."""
    pad, name = " " * indent, f"{key}=" if key else ""
    one = f"{pad}{name}{_quote(text)},"
    if len(one) <= WIDTH:
        return [one]
    parts = textwrap.wrap(text, WIDTH - indent - 8, drop_whitespace=False, break_long_words=False)
    return [f"{pad}{name}(", *(f"{pad}    {_quote(part)}" for part in parts), f"{pad}),"]


def _paragraph(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, WIDTH - len(indent) - 4, initial_indent=indent, subsequent_indent=indent) or [indent]


def _plain_default(node: ast.expr) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant)


def signature(node: ast.AST | None) -> tuple[str, str] | None:
    """``(parameters, call arguments)`` of a plain ``def`` (every parameter typed ``Any``), so that the replacement
    takes what the original takes; None for anything else (a decorated def, a property, a default that names
    something of upstream's), whose builder then starts from ``original`` alone."""
    if not isinstance(node, ast.FunctionDef) or node.decorator_list:
        return None
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params, call = [], []
    for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        if default is not None and not _plain_default(default):
            return None
        params.append(f"{arg.arg}: Any" + (f" = {ast.unparse(default)}" if default is not None else ""))
        call.append(arg.arg)
        if a.posonlyargs and i == len(a.posonlyargs) - 1:
            params.append("/")
    if a.vararg:
        params.append(f"*{a.vararg.arg}: Any")
        call.append(f"*{a.vararg.arg}")
    elif a.kwonlyargs:
        params.append("*")
    for arg, kw_default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        if kw_default is not None and not _plain_default(kw_default):
            return None
        params.append(f"{arg.arg}: Any" + (f" = {ast.unparse(kw_default)}" if kw_default is not None else ""))
        call.append(f"{arg.arg}={arg.arg}")
    if a.kwarg:
        params.append(f"**{a.kwarg.arg}: Any")
        call.append(f"**{a.kwarg.arg}")
    return ", ".join(params), ", ".join(call)


def _builder_names(targets: list[TargetSpec]) -> list[str]:
    if len(targets) == 1:
        return ["_build"]
    names = [f"_build_{t.attribute.strip('_')}" for t in targets]
    if len(set(names)) < len(names):
        names = [f"_build_{t.qualname.replace('.', '_').strip('_').lower()}" for t in targets]
    return names


#: What each builder stub asks for.
FIX = (
    f"{STUB}: write the fix around `original`: prepare its inputs, call it, mend what it returns (a delta, never a "
    "copy of upstream's body; on a hot path no wrapper layer, host sync or decision per call)"
)


def _builder(target: TargetSpec, name: str) -> list[str]:
    head = [f'@PATCH.replace("{target.module}", "{target.qualname}")', f"def {name}(original: Any) -> Any:"]
    if target.signature is None:
        declines = "; return a plain function that calls `original` (returning `original` itself declines: no change)"
        return [*head, *_paragraph(FIX + declines, "    # "), "    return original"]
    params, call = target.signature
    return [
        *head,
        f"    def {target.attribute}({params}) -> Any:",
        *_paragraph(FIX, "        # "),
        f"        return original({call})",
        "",
        f"    return {target.attribute}",
    ]


def render_unit(patch: Patch, targets: list[TargetSpec]) -> str:
    """The unit's source (ruff-formatted except for its builders' signatures, which :func:`main` formats)."""
    upstream = f"Upstream: {patch.reference}" + (
        f"; fixed in {patch.fixed_in}" + (f" ({patch.fixed_commit})" if patch.fixed_commit else "") + "."
        if patch.fixed_in
        else f"; not fixed as of {patch.checked_through}."
    )
    lines = [
        *_paragraph(f'"""{patch.id} (catalogue {patch.catalogue}): {patch.summary}.'),
        "",
        *_paragraph(
            f"Broken: {STUB}: what goes wrong in which upstream code, on which releases (measured how: the "
            "reproduction's numbers), and what a user sees."
        ),
        "",
        *_paragraph(upstream),
        "",
        *_paragraph(
            f"Fix: {STUB}: the delta around the original (what it prepares, calls and mends), and why it is right "
            "and cheap where it runs."
        ),
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "import datetime as _dt",
        "from typing import Any",
        "",
        "from kvpatch.record import Expiry, Finding, Patch",
        "",
        "PATCH = Patch(",
        '    # every field: CONTRIBUTING.md, "The record"',
        f'    id="{patch.id}",',
        *_string("summary", patch.summary, 4),
        f'    distribution="{patch.distribution}",',
        f'    affected="{patch.affected}",',
    ]
    for key in ("fixed_in", "fixed_commit", "checked_through"):
        if getattr(patch, key) is not None:
            lines.append(f'    {key}="{getattr(patch, key)}",')
    lines += [
        *_string("reference", patch.reference, 4),
        *_string("catalogue", patch.catalogue, 4),
        f"    hot_path={patch.hot_path},",
        "    expiry=Expiry(",
        *_string("", patch.expiry.condition, 8),
    ]
    review_by = patch.expiry.review_by or _dt.date.today() + REVIEW_AFTER
    lines += [
        f"        review_by=_dt.date({review_by.year}, {review_by.month}, {review_by.day}),",
        "    ),",
        ")",
    ]
    for target, name in zip(targets, _builder_names(targets), strict=True):
        lines += ["", "", *_builder(target, name)]
    lines += [
        "",
        "",
        "@PATCH.reproduce",
        "def reproduce() -> Finding:",
        f'    """{STUB}: one sentence: what this runs, and what it compares the result with."""',
        *_paragraph(
            f"{STUB}: write the reproduction: the bug's smallest case on the real upstream, with mlx and the target "
            "imported here (never at the unit's top). Compare numbers one way (kvpatch/patches/_numbers.py): data "
            "kvpatch only moves (offsets, shapes, masks, copied rows) with exact(got, want); a computed result "
            '(attention, logits) with judge(difference(got, want), "<what differs>", "<what matches>"), which sizes '
            "the bug against the rounding of the backend and dtype. The bug's own exception: symptom(exc, "
            '"<its message>") from kvpatch.record. Return Finding(True, detail) where the bug shows, Finding(False, '
            "detail) where it does not.",
            "    # ",
        ),
        f'    return Finding(False, inconclusive="{STUB}: the reproduction is not written yet")',
    ]
    return "\n".join(lines) + "\n"


def newest_bucket(patch: Patch) -> str | None:
    """The newest matrix bucket whose release of the patch's distribution is in its affected range."""
    prefix = "lm-" if patch.distribution == "mlx-lm" else "vlm-"
    inside = [
        b for b in BUCKETS if b.name.startswith(prefix) and patch.range.contains(b.version(patch.distribution) or "0")
    ]
    return inside[-1].name if inside else None


def render_test(patch: Patch) -> str:
    module = registry.module_for(patch.id, patch.distribution)
    path = test_path(patch.id).relative_to(REPO)
    bucket = newest_bucket(patch) or "<bucket of an affected release>"
    run = f".venv/bin/python scripts/in_bucket.py {bucket} -- python -m pytest {path} -q"
    lines = [
        *_paragraph(
            f'"""{patch.id} ({patch.catalogue}) beyond its reproduction: {STUB}: what these tests show, on a tiny '
            "random-weight model built from ModelArgs (kvpatch.testing.tiny_llama), and what the fix leaves as "
            'upstream has it."""'
        ),
        "",
        "from __future__ import annotations",
        "",
        "import pytest",
        "",
        f"from {module} import PATCH",
        "",
        "# skips where the installed upstream is not in the patch's range (tests/upstream/conftest.py)",
        "pytestmark = pytest.mark.requires_patch(PATCH.id)",
        "",
        "",
        "def test_fixed_behaviour():",
        f"    # {STUB}: show the fixed behaviour. It fails without the patch on an affected release, passes with it:",
        f"    #   KVPATCH_DISABLE={patch.id} {run}   # fails",
        f"    #   {run}   # passes",
        "    # Numbers: exact(got, want) or difference(got, want).within (kvpatch.patches._numbers), never a literal.",
        f'    pytest.fail("{STUB}: write the test of the fixed behaviour")',
    ]
    return "\n".join(lines) + "\n"


def with_changelog_entry(changelog: str, patch: Patch) -> str:
    """``changelog`` (CHANGELOG.md's text) with the new patch's line first under ``## [Unreleased]`` / ``### Added``
    (a new patch is a change users see: CONTRIBUTING.md, "Adding a patch")."""
    entry = f"- Patch `{patch.id}` (catalogue {patch.catalogue}): {patch.summary}."
    head = "## [Unreleased]\n"
    start = changelog.find(head)
    if start < 0:
        raise ValueError("CHANGELOG.md has no '## [Unreleased]' section")
    end = changelog.find("\n## [", start + len(head))
    end = len(changelog) if end < 0 else end + 1
    section = changelog[start:end]
    if "\n### Added\n\n" in section:
        section = section.replace("\n### Added\n\n", f"\n### Added\n\n{entry}\n", 1)
    else:
        section = section.rstrip("\n") + f"\n\n### Added\n\n{entry}\n\n"
    return changelog[:start] + section + changelog[end:]


# -- reading the targets from a release ----------------------------------------------------------------------------


def _roots(import_name: str, patch: Patch, *, offline: bool) -> list[tuple[str, Path]]:
    """Cached layers of the distribution ``import_name`` belongs to, newest first, those in the patch's range first;
    with none in range and not ``offline``, the newest matrix release in range is layered (the fingerprints need it
    anyway)."""
    dist = next(d for d, name in DISTRIBUTIONS.items() if name == import_name)
    cached = envs.cached_versions(dist)
    in_range = [v for v in cached if dist != patch.distribution or patch.range.contains(v)]
    if not in_range and not offline and dist == patch.distribution:
        wanted = [v for v in TESTED.get(dist, ()) if patch.range.contains(v)] or [patch.checked_through or ""]
        if wanted[-1]:
            print(f"reading the targets from {dist} {wanted[-1]}: layering it", file=sys.stderr, flush=True)
            envs.layer(f"{dist}=={wanted[-1]}")
            in_range = [wanted[-1]]
    ordered = sorted(in_range, key=Version, reverse=True) + sorted(
        set(cached) - set(in_range), key=Version, reverse=True
    )
    layers = envs.cache_dir() / "layers"
    return [(f"{dist} {v}", layers / envs.layer_key(f"{dist}=={v}")) for v in ordered]


def resolve(text: str, patch: Patch, *, offline: bool) -> TargetSpec:
    """``module.Qual.name`` (or ``module:Qual.name``) as module and qualified name, with the original's signature,
    from the newest release layer that has the module; without one, the qualified name starts at the first
    capitalised part (else it is the last part). Says what it found."""
    parts = text.replace(":", ".").split(".")
    roots = _roots(parts[0], patch, offline=offline) if parts[0] in DISTRIBUTIONS.values() else []
    splits = [text.split(":", 1)] if ":" in text else [parts[:i] for i in range(len(parts) - 1, 0, -1)]
    for where, root in roots:
        for split in splits:
            module = split[0] if ":" in text else ".".join(split)
            qualname = split[1] if ":" in text else ".".join(parts[len(split) :])
            file = module_file(root, module)
            if file is None:
                continue
            node = definition(file.read_text(encoding="utf-8"), qualname)
            if node is None:
                print(f"note: {where} has no {qualname} in {module}: check the name", file=sys.stderr)
            else:
                print(f"target {module}.{qualname}: read from {where} ({file.name})", file=sys.stderr)
            return TargetSpec(module, qualname, signature(node))
    if ":" in text:
        module, qualname = text.split(":", 1)
    else:
        first = next((i for i, p in enumerate(parts) if i and p[:1].isupper()), len(parts) - 1)
        module, qualname = ".".join(parts[:first]), ".".join(parts[first:])
    print(
        f"note: no cached release layer has {module}: took {module} : {qualname} (say module:Qual.name otherwise)",
        file=sys.stderr,
    )
    return TargetSpec(module, qualname)


# -- the command ---------------------------------------------------------------------------------------------------


def _ruff(paths: list[Path]) -> None:
    """Format the new files as the tree's lint test wants them (ruff is in the test dependency group)."""
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).is_file():
        print(f"note: ruff not found: run `ruff format {' '.join(map(str, paths))}`", file=sys.stderr)
        return
    subprocess.run([ruff, "format", "--quiet", *map(str, paths)], check=False)


def _upper(affected: str) -> str | None:
    from packaging.specifiers import SpecifierSet

    return next((s.version for s in SpecifierSet(affected) if s.operator == "<="), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvpatch.maint.new",
        description="Write a new patch unit and its test (stubs marked " + STUB + ") and regenerate the derived files.",
        epilog="Run from the root of a clone. Afterwards write what the "
        + STUB
        + " lines ask; `bash scripts/test.sh --quick` lists those still left.",
    )
    parser.add_argument("id", help="the patch id: lower-case words joined by '-' (KVPATCH_DISABLE names it)")
    parser.add_argument(
        "--package", required=True, choices=sorted(DISTRIBUTIONS), help="the distribution that gates it"
    )
    parser.add_argument("--affected", required=True, metavar="SPEC", help="released versions with the bug: '>=A,<=B'")
    parser.add_argument(
        "--target",
        action="append",
        required=True,
        metavar="module.Qual.name",
        help="an attribute the fix replaces (repeat for more); module:Qual.name when the split is ambiguous",
    )
    parser.add_argument("--summary", required=True, help="what goes wrong, in one line (status and COMPAT.md show it)")
    parser.add_argument(
        "--catalogue", required=True, help="the bug's catalogue id ('C4'), or the issue that reported it"
    )
    parser.add_argument("--reference", default="not reported upstream", help="upstream's 'owner/repo#N', or a URL")
    parser.add_argument("--fixed-in", help="the first release with upstream's fix (then --affected ends before it)")
    parser.add_argument("--fixed-commit", help="upstream's fixing commit (hex prefix)")
    parser.add_argument("--checked-through", help="the newest release measured (default: --affected's '<=' bound)")
    parser.add_argument("--hot-path", action="store_true", help="a target runs per token / per layer per step")
    parser.add_argument("--review-by", type=_dt.date.fromisoformat, help="YYYY-MM-DD (default: in six months)")
    parser.add_argument("--offline", action="store_true", help="download nothing (regenerate --offline)")
    parser.add_argument("--no-regenerate", action="store_true", help="write the two files only")
    args = parser.parse_args(argv)

    if not (REPO / "scripts" / "record_fingerprints.py").is_file() or not (REPO / "tests" / "upstream").is_dir():
        print(
            f"{REPO} is not a clone of kvpatch: run `python -m kvpatch.maint.new` from a clone's root", file=sys.stderr
        )
        return 2
    fixed = args.fixed_in
    condition = (
        f"retire when kvpatch stops supporting {args.package} < {fixed}"
        if fixed
        else f"retire when an {args.package} release fixes it (`python -m kvpatch upstream-check` measures the newest)"
    )
    try:
        patch = Patch(
            id=args.id,
            summary=args.summary.strip().rstrip("."),
            distribution=args.package,
            affected=args.affected,
            reference=args.reference,
            catalogue=args.catalogue,
            fixed_in=fixed,
            fixed_commit=args.fixed_commit,
            checked_through=args.checked_through or (None if fixed else _upper(args.affected)),
            hot_path=args.hot_path,
            expiry=Expiry(condition, review_by=args.review_by or _dt.date.today() + REVIEW_AFTER),
        )
    except RecordError as exc:
        hint = (
            " (--checked-through VERSION, or end --affected with '<=VERSION')" if "checked_through" in str(exc) else ""
        )
        print(f"kvpatch.maint.new: {exc}{hint}", file=sys.stderr)
        return 64
    problems = record_problems(patch)
    unit, test = unit_path(patch.id, patch.distribution), test_path(patch.id)
    taken = [p.id for p in registry.load().patches if p.id == patch.id]
    problems += [f"{path.relative_to(REPO)} exists already" for path in (unit, test) if path.exists()]
    problems += [f"the id {patch.id!r} is taken (`kvpatch list`)" for _ in taken]
    if problems:
        print("\n".join(f"kvpatch.maint.new: {p}" for p in problems), file=sys.stderr)
        return 64
    targets = [resolve(text, patch, offline=args.offline) for text in args.target]
    for t in targets:
        try:
            patch.replace(t.module, t.qualname)(lambda original: original)
        except RecordError as exc:
            print(f"kvpatch.maint.new: {exc}", file=sys.stderr)
            return 64
    unit.write_text(render_unit(patch, targets), encoding="utf-8")
    test.write_text(render_test(patch), encoding="utf-8")
    _ruff([unit, test])
    print(f"wrote {unit.relative_to(REPO)} and {test.relative_to(REPO)}")
    changelog = REPO / "CHANGELOG.md"
    if changelog.is_file():
        changelog.write_text(with_changelog_entry(changelog.read_text(encoding="utf-8"), patch), encoding="utf-8")
        print("added its line to CHANGELOG.md (## [Unreleased], ### Added)")
    rc = 0
    if not args.no_regenerate:
        from . import regenerate

        importlib.invalidate_caches()
        registry.load.cache_clear()
        rc = regenerate.main(["--only", patch.id, *(["--offline"] if args.offline else [])])
    left = unfinished()
    print(f"\nnext: write what each {STUB} line asks ({len(left)} left):")
    print("\n".join(f"  {line}" for line in left))
    print(
        "then: bash scripts/test.sh --quick   (it reinstalls kvpatch from this checkout and lists what is still a stub)"
    )
    if rc:
        print(
            f"regeneration failed (above): fix what it names, then run "
            f"`python -m kvpatch.maint.regenerate --only {patch.id}`"
        )
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
