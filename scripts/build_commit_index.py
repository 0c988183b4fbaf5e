#!/usr/bin/env python3
"""Build kvpatch's commit indexes of mlx-lm and mlx-vlm from local git mirrors.

Writes ``kvpatch/data/commits-mlx-lm.txt`` and ``kvpatch/data/commits-mlx-vlm.txt``:
the first-parent ("main-line") history of each upstream's default branch, oldest
first, one commit per line, with pull-request numbers and release tags, plus the
commits that reached the main line through merges of side branches.  Only commit
ids, their order, PR numbers and tag names are written -- no upstream source.

``kvpatch.commits`` reads these files to tell whether a commit pinned by a PEP 610
``direct_url.json`` (``vcs_info.commit_id``) is before or after the upstream commit
that fixed (or introduced) a bug.

Usage::

    python scripts/build_commit_index.py [--mlx-lm DIR] [--mlx-vlm DIR] [--check]

Each DIR is a git directory (bare or not) holding the upstream history.  Without
the option, the mirror at ``/work/.mirror/<owner>+<name>/repo`` is used when present.
The output is deterministic: the same mirror state gives byte-identical files (the
``generated`` field is the committer date of the indexed head, not the wall clock).
Standard library only.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO_ROOT / "kvpatch" / "data"


@dataclass(frozen=True)
class Upstream:
    distribution: str  # PyPI name, also used in the output file name
    source: str  # where the history comes from (informational)
    default_mirror: Path


UPSTREAMS = (
    Upstream("mlx-lm", "github.com/ml-explore/mlx-lm", Path("/work/.mirror/ml-explore+mlx-lm/repo")),
    Upstream("mlx-vlm", "github.com/Blaizzy/mlx-vlm", Path("/work/.mirror/Blaizzy+mlx-vlm/repo")),
)

HEX40 = re.compile(r"^[0-9a-f]{40}$")
# Release tags: v0.6.0, v0.31.3, also tolerate v1.2.3rc1 / v1.2.3-post1.
RELEASE_TAG = re.compile(r"^v\d+(?:\.\d+)+(?:[.+-]?[0-9A-Za-z]+)*$", re.ASCII)
# Squash merges end with "(#1208)"; true merges say "Merge pull request #2002 from ...".
PR_SQUASH = re.compile(r"\(#(\d+)\)\s*$")
PR_MERGE = re.compile(r"^Merge pull request #(\d+)\b")

FORMAT_DOC = """\
# Format, one commit per line, oldest first:
#   <40-hex>[ #PR][ vX.Y.Z ...]
#       a commit on the first-parent main line of the branch; its position is
#       its rank among these lines (0 = oldest).  #PR is the pull-request number
#       parsed from the subject ("... (#N)" or "Merge pull request #N"); for
#       history imported from another repository it refers to that repository.
#   +<40-hex>
#       a commit that reached the main line from a side branch; it belongs to
#       the nearest main-line line above it, i.e. the merge commit that first
#       brought it in, and takes that line's position.
# Release tags: a tag on a main-line commit is written on that commit's line.
# A tag on a side commit is written on the first main-line commit that contains
# it (the merge that brought it in) and noted below; a tag that is not reachable
# from the branch at all is only noted below.  Upstream tags and PyPI wheels
# disagree in places, so tags are informational only: never gate on them."""


class GitError(RuntimeError):
    pass


def git(git_dir: Path, *args: str) -> str:
    cmd = ["git", "--git-dir", str(git_dir), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", errors="replace", check=False)
    if proc.returncode != 0:
        raise GitError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def find_git_dir(path: Path) -> Path:
    """Accept a git dir (bare or not) or a work tree; return the absolute git dir."""
    proc = subprocess.run(
        ["git", "-C", str(path), "rev-parse", "--absolute-git-dir"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise GitError(f"{path} is not a git directory: {proc.stderr.strip()}")
    return Path(proc.stdout.strip())


def resolve_commit(git_dir: Path, ref: str) -> str | None:
    proc = subprocess.run(
        ["git", "--git-dir", str(git_dir), "rev-parse", "--verify", "-q", f"{ref}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    out = proc.stdout.strip()
    return out if proc.returncode == 0 and HEX40.match(out) else None


def default_branch(git_dir: Path, requested: str | None) -> tuple[str, str]:
    """Return (branch name, head commit) of the branch to index.

    Order: the requested branch; what HEAD points at (a clone's or mirror's
    default branch); then main, master (local or origin/).
    """
    candidates: list[str] = []
    if requested:
        candidates += [f"refs/heads/{requested}", f"refs/remotes/origin/{requested}", requested]
    proc = subprocess.run(
        ["git", "--git-dir", str(git_dir), "symbolic-ref", "-q", "HEAD"], capture_output=True, text=True, check=False
    )
    if proc.returncode == 0 and proc.stdout.strip():
        candidates.append(proc.stdout.strip())
    candidates += ["refs/heads/main", "refs/remotes/origin/main", "refs/heads/master", "refs/remotes/origin/master"]
    for ref in candidates:
        head = resolve_commit(git_dir, ref)
        if head:
            name = ref.removeprefix("refs/heads/").removeprefix("refs/remotes/")
            return name, head
    raise GitError(f"{git_dir}: no default branch found (tried {', '.join(candidates)})")


def pr_number(subject: str) -> int | None:
    m = PR_MERGE.match(subject) or PR_SQUASH.search(subject)
    return int(m.group(1)) if m else None


def version_key(tag: str) -> tuple[tuple[int, ...], str]:
    nums = re.match(r"^v((?:\d+\.?)+)", tag)
    parts = tuple(int(p) for p in nums.group(1).strip(".").split(".")) if nums else ()
    # "v1.2.3" sorts before "v1.2.3.post1"-style suffixes only by the string tie-break.
    return parts, tag


@dataclass
class Index:
    mainline: list[str]  # oldest first
    subjects: dict[str, str]  # main-line commit -> subject
    owner: dict[str, int]  # every commit reachable from head -> main-line position
    side_order: list[str]  # side commits, topological order, oldest first
    tags: dict[int, list[str]]  # main-line position -> tags
    notes: list[str]  # comment lines about tags


def build(git_dir: Path, head: str, branch: str) -> Index:
    mainline: list[str] = []
    subjects: dict[str, str] = {}
    for line in git(git_dir, "log", "--first-parent", "--reverse", "--format=%H%x09%s", head).splitlines():
        sha, _, subject = line.partition("\t")
        mainline.append(sha)
        subjects[sha] = subject

    parents: dict[str, list[str]] = {}
    topo: list[str] = []
    for line in git(git_dir, "rev-list", "--parents", "--topo-order", "--reverse", head).splitlines():
        sha, *ps = line.split()
        parents[sha] = ps
        topo.append(sha)

    # Assign each commit to the first main-line commit that contains it.  Walking the
    # main line oldest first, the commits new in M_i are ancestors(M_i) minus
    # ancestors(M_{i-1}); since everything assigned so far is an ancestor of M_{i-1}
    # (and that set is closed under "parent of"), a walk from M_i that stops at
    # assigned commits finds exactly them.
    owner: dict[str, int] = {}
    for pos, sha in enumerate(mainline):
        stack = [sha]
        while stack:
            c = stack.pop()
            if c in owner:
                continue
            owner[c] = pos
            stack.extend(parents[c])
    if len(owner) != len(parents):
        raise GitError(f"internal error: {len(parents)} commits but {len(owner)} assigned")
    mainline_set = set(mainline)
    side_order = [c for c in topo if c not in mainline_set]

    tags: dict[int, list[str]] = {}
    notes: list[str] = []
    fmt = "%(refname:strip=2)%09%(objecttype)%09%(objectname)%09%(*objecttype)%09%(*objectname)"
    for line in sorted(git(git_dir, "for-each-ref", f"--format={fmt}", "refs/tags").splitlines()):
        name, otype, oid, ptype, poid = (line.split("\t") + [""] * 5)[:5]
        if not RELEASE_TAG.match(name):
            continue
        if otype == "commit":
            target = oid
        elif otype == "tag" and ptype == "commit":
            target = poid
        else:
            notes.append(f"# tag {name}: does not point at a commit; omitted")
            continue
        tag_pos = owner.get(target)
        if tag_pos is None:
            proc = subprocess.run(
                ["git", "--git-dir", str(git_dir), "merge-base", target, head],
                capture_output=True,
                text=True,
                check=False,
            )
            base = proc.stdout.strip()
            where = f" (it forks from main-line {mainline[owner[base]]})" if base in owner else ""
            notes.append(f"# tag {name}: {target} is not reachable from {branch}{where}; omitted")
            continue
        if target not in mainline_set:
            notes.append(f"# tag {name}: {target} is on a side branch; written on main-line {mainline[tag_pos]}")
        tags.setdefault(tag_pos, []).append(name)
    for names in tags.values():
        names.sort(key=version_key)
    notes.sort(key=lambda n: version_key(n.split()[2].rstrip(":")))
    return Index(mainline, subjects, owner, side_order, tags, notes)


def render(up: Upstream, branch: str, head: str, head_time: int, index: Index) -> str:
    generated = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(head_time))
    by_owner: dict[int, list[str]] = {}
    for c in index.side_order:
        by_owner.setdefault(index.owner[c], []).append(c)
    out = [
        f"# kvpatch commit index: {up.distribution}",
        f"# distribution: {up.distribution}",
        f"# source: {up.source}",
        f"# branch: {branch}",
        f"# head: {head}",
        f"# generated: {generated}",
        "#   (the committer date of head, so that rebuilding from the same mirror gives the same file)",
        f"# mainline: {len(index.mainline)}",
        f"# side: {len(index.side_order)}",
        "# built by scripts/build_commit_index.py; do not edit by hand",
        FORMAT_DOC,
        *index.notes,
    ]
    for pos, sha in enumerate(index.mainline):
        fields = [sha]
        pr = pr_number(index.subjects[sha])
        if pr is not None:
            fields.append(f"#{pr}")
        fields += index.tags.get(pos, [])
        out.append(" ".join(fields))
        out.extend(f"+{c}" for c in by_owner.get(pos, []))
    return "\n".join(out) + "\n"


def generate(up: Upstream, git_dir: Path, branch: str | None) -> str:
    git_dir = find_git_dir(git_dir)
    branch_name, head = default_branch(git_dir, branch)
    head_time = int(git(git_dir, "log", "-1", "--format=%ct", head).strip())
    return render(up, branch_name, head, head_time, build(git_dir, head, branch_name))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for up in UPSTREAMS:
        ap.add_argument(
            f"--{up.distribution}",
            type=Path,
            metavar="DIR",
            help=f"git dir of {up.source} (default: {up.default_mirror} if present)",
        )
    ap.add_argument("--branch", help="branch to index (default: what HEAD points at, else main, else master)")
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="default: %(default)s")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file would change")
    args = ap.parse_args(argv)

    status = 0
    done = 0
    for up in UPSTREAMS:
        given: Path | None = getattr(args, up.distribution.replace("-", "_"))
        git_dir = given or (up.default_mirror if up.default_mirror.exists() else None)
        if git_dir is None:
            print(
                f"{up.distribution}: no --{up.distribution} and no mirror at {up.default_mirror}; skipped",
                file=sys.stderr,
            )
            continue
        text = generate(up, git_dir, args.branch)
        path = args.out_dir / f"commits-{up.distribution}.txt"
        old = path.read_text(encoding="ascii") if path.exists() else None
        if args.check:
            if old != text:
                print(f"{path}: out of date", file=sys.stderr)
                status = 1
        elif old != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="ascii", newline="\n")
            print(f"{path}: written ({len(text.encode())} bytes)", file=sys.stderr)
        else:
            print(f"{path}: unchanged", file=sys.stderr)
        done += 1
    if done == 0:
        print("nothing to index: give --mlx-lm DIR and/or --mlx-vlm DIR", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
