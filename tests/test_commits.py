"""Tests of kvpatch.commits on the real shipped commit indexes (kvpatch/data/commits-*.txt).

Every fact below was checked against the upstream git mirrors: full ids, first-parent
main-line membership (``git rev-list --first-parent``), the main-line commit that first
contains a side commit (``git merge-base --is-ancestor`` on it and its predecessor),
and the pull request that brought it in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvpatch.commits import CommitIndex, Placement, load_index, place
from kvpatch.record import DISTRIBUTIONS

ROOT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = ROOT / "scripts" / "build_commit_index.py"


def position(index: CommitIndex, commit: str) -> int | None:
    """Main-line position (0 = oldest; a side commit: its merge's), or None if ``commit`` is not indexed."""
    full = index.resolve(commit)
    return None if full is None else index._position[full]


MIRRORS = {
    "mlx-lm": Path("/work/.mirror/ml-explore+mlx-lm/repo"),
    "mlx-vlm": Path("/work/.mirror/Blaizzy+mlx-vlm/repo"),
}

# (distribution, short id, full id, on the first-parent main line?, main-line commit
#  that first contains it, PR number)
FIXES = [
    ("mlx-lm", "a9e1e82c", "a9e1e82c6174ac8f0896836b0a0dd3b97a533bc9", True, None, 121),
    ("mlx-lm", "89c430a9", "89c430a9c2696ac24ce4be39f75e5467bea137da", True, None, 960),
    ("mlx-lm", "63c98736", "63c9873617a9ffc8a369d2428e26a259e4241823", True, None, 755),
    ("mlx-lm", "a4017309", "a40173094136fbcbfb41966889a22530c83bd86e", True, None, 1165),
    ("mlx-lm", "a790972f", "a790972f0f844d81067ed45c28b524220a10c019", True, None, 1467),
    ("mlx-lm", "62f38aeb", "62f38aeb51da77f595be7161ba7caa119ca5234a", True, None, 1141),
    ("mlx-lm", "e03e45ed", "e03e45edc5af6a895bfb386ddc0e79fd072763d0", True, None, 1673),
    ("mlx-lm", "11a6ce75", "11a6ce75589f59809d6d79b28efa03c50896c18b", True, None, 1632),
    ("mlx-vlm", "2a55b80b", "2a55b80bf1ce68a83a3e3b688623a070cc3a6a63", True, None, 1208),
    ("mlx-vlm", "654caf4c", "654caf4cd7cadec1dace2ebae50f0e63c028077b", True, None, 1248),
    ("mlx-vlm", "73a1291a", "73a1291a4c1720894b196f5ae5f568da7dc99886", True, None, 1453),
    ("mlx-vlm", "1171888e", "1171888e5f72bcb3722b234e30fbcefd01901a3f", True, None, 1447),
    ("mlx-vlm", "6bf878cb", "6bf878cb6d3606039128c31864b077280930f490", True, None, 1432),
    ("mlx-vlm", "0cdae975", "0cdae9754771496a80ac7c4c457762593f5058dd", True, None, 1975),
    ("mlx-vlm", "c84cf87b", "c84cf87b9ea342c3e101e217624f07b579f917d3", True, None, 1568),
    # A side-branch commit, merged by c8d6057c ("Merge pull request #1890").
    (
        "mlx-vlm",
        "570afed3",
        "570afed369fd396f7b07b469a5104e1b38bc3310",
        False,
        "c8d6057c",
        1890,
    ),
    ("mlx-vlm", "dccd29f4", "dccd29f46adc3cf8a787dea5c86aacbd0dd04724", True, None, 1916),
    ("mlx-vlm", "048642ff", "048642ff05c22005a795f86fcc823e9fb61dbfe6", True, None, 973),
    ("mlx-vlm", "3ef17cbc", "3ef17cbcc4b9817c9a1fa9df4f49db82647c7750", True, None, 1244),
    ("mlx-vlm", "1090328a", "1090328ab4245b9a65f3060d51c8ab28ac217695", True, None, 1252),
    # Introduced bug V01 (KV cache quantization for continuous batching).
    ("mlx-vlm", "b0275383", "b0275383f1bb8cbadf1e7f1c2b7615e86e91042d", True, None, 1030),
]

V01_INTRODUCED = "b0275383"
V01_FIXED = "2a55b80b"
V02_FIXED = "654caf4c"

# mlx-vlm pins seen in the wild: (pin, has V01, has V02)
PINS = [
    ("f96138ee", True, True),
    ("fea81522", False, True),
    ("6f60ee44", False, False),
]


@pytest.mark.parametrize(("dist", "short", "full", "mainline", "merged_by", "pr"), FIXES)
def test_fixing_commits(dist: str, short: str, full: str, mainline: bool, merged_by: str | None, pr: int) -> None:
    index = load_index(dist)
    assert index.resolve(short) == full
    assert index.resolve(full) == full
    assert index.resolve(full.upper()) == full
    container = index.mainline[position(index, short) or 0]
    assert container is not None
    if mainline:
        assert container == full
    else:
        assert merged_by is not None
        assert container.startswith(merged_by)
    assert position(index, short) == position(index, container)
    assert index.describe(short).endswith(f"#{pr})")
    # Every commit contains itself; the main-line commit before its merge does not.
    pos = position(index, short)
    assert pos is not None
    assert index.contains(container, short) is True
    if pos > 0:
        assert index.contains(index.mainline[pos - 1], short) is False


@pytest.mark.parametrize(("pin", "has_v01", "has_v02"), PINS)
def test_pins_in_the_wild(pin: str, has_v01: bool, has_v02: bool) -> None:
    index = load_index("mlx-vlm")
    assert index.contains(pin, V01_FIXED) is (not has_v01)
    assert index.contains(pin, V02_FIXED) is (not has_v02)
    assert index.contains(pin, V01_INTRODUCED) is True

    full = index.resolve(pin)
    assert full is not None and full.startswith(pin)
    assert index.mainline[position(index, pin) or 0] == full
    v01 = place("mlx-vlm", pin, fixed_commit=V01_FIXED, introduced_commit=V01_INTRODUCED)
    assert v01.known
    assert v01.introduced is True
    assert v01.fixed is (not has_v01)

    v02 = place("mlx-vlm", pin, fixed_commit=V02_FIXED)
    assert v02.fixed is (not has_v02)
    assert v02.introduced is None
    word = "before" if has_v02 else "at or after"
    assert v02.reason == f"pinned commit {pin} is {word} the fix 654caf4c (#1248)"


def test_reason_matches_brief() -> None:
    p = place("mlx-vlm", "f96138eef1f5ce7fb5d97f8dd41a664a195b5659", fixed_commit="2a55b80b")
    assert p.reason == "pinned commit f96138ee is before the fix 2a55b80b (#1208)"


def test_unknown_pin() -> None:
    index = load_index("mlx-vlm")
    p = place("mlx-vlm", "deadbeef", fixed_commit=V01_FIXED)
    assert isinstance(p, Placement)
    assert not p.known
    assert p.fixed is None
    assert p.introduced is None
    assert p.reason == (
        "commit deadbeef is not on mlx-vlm's main line in kvpatch's index "
        f"(generated {index.generated:%Y-%m-%d} from head {index.head[:7]}); the reproduction decides"
    )
    assert index.contains("deadbeef", V01_FIXED) is None
    assert index.contains(V01_FIXED, "deadbeef") is None
    assert position(index, "deadbeef") is None


def test_unknown_fix_commit() -> None:
    p = place("mlx-vlm", "6f60ee44", fixed_commit="0123456789abcdef")
    assert p.known
    assert p.fixed is None
    assert "the fix 0123456789abcdef is not in kvpatch's index of mlx-vlm" in p.reason


@pytest.mark.parametrize(
    "query",
    [
        "",
        "2a55b8",  # 6 hex chars: shorter than the 7-char minimum
        "2a55b80g",  # not hex
        "2a55b80bf1ce68a83a3e3b688623a070cc3a6a63a",  # 41 chars
        "0000000000000000000000000000000000000000",  # well-formed, not indexed
    ],
)
def test_resolve_rejects(query: str) -> None:
    assert load_index("mlx-vlm").resolve(query) is None


def test_resolve_minimum_prefix() -> None:
    index = load_index("mlx-vlm")
    assert index.resolve("2a55b80") == "2a55b80bf1ce68a83a3e3b688623a070cc3a6a63"
    assert index.resolve("  2A55B80B\n") == "2a55b80bf1ce68a83a3e3b688623a070cc3a6a63"


def test_resolve_ambiguous_prefix() -> None:
    # The shipped indexes have no 7-char collision, so build one.
    index = CommitIndex.parse(
        "# head: 1234567bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb\n"
        "# generated: 2026-01-01T00:00:00+00:00\n"
        "1234567aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa #1 v0.1.0\n"
        "+1234567ccccccccccccccccccccccccccccccccc\n"
        "1234567bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb #2\n",
        "demo",
    )
    assert index.resolve("1234567") is None
    assert index.resolve("1234567a") == "1234567aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
    assert index.resolve("1234567c") == "1234567ccccccccccccccccccccccccccccccccc"
    assert position(index, "1234567c") == 0
    assert index.contains("1234567b", "1234567c") is True
    assert index.contains("1234567c", "1234567b") is False


def test_real_index_has_no_ambiguous_seven_char_prefix() -> None:
    for dist in DISTRIBUTIONS:
        index = load_index(dist)
        ids = sorted(index._sorted)
        prefixes = {c[:7] for c in ids}
        assert len(prefixes) == len(ids), dist


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_index_shape(dist: str) -> None:
    index = load_index(dist)
    assert index.distribution == dist
    assert index.head == index.mainline[-1]
    assert index.generated.tzinfo is not None
    assert len(set(index.mainline)) == len(index.mainline)
    text = (ROOT / "kvpatch" / "data" / f"commits-{dist}.txt").read_text()
    header = dict(line[2:].split(": ", 1) for line in text.splitlines() if line.startswith("# ") and ": " in line)
    assert header["branch"] == "main"
    assert int(header["mainline"]) == len(index.mainline)
    assert int(header["side"]) == len(index._position) - len(index.mainline)


def test_positions_are_ordered() -> None:
    index = load_index("mlx-vlm")
    order = ["b0275383", "f96138ee", "2a55b80b", "fea81522", "654caf4c", "6f60ee44"]
    positions = [position(index, c) for c in order]
    assert all(p is not None for p in positions)
    assert positions == sorted(positions)  # type: ignore[type-var]
    assert len(set(positions)) == len(positions)


def test_side_pin() -> None:
    # A pin on a merged side branch: later fixes are known to be missing, earlier ones can't be told.
    later = place("mlx-vlm", "570afed3", fixed_commit="dccd29f4")
    assert later.known
    assert later.fixed is False
    assert later.reason == "pinned commit 570afed3 (merged by c8d6057c, #1890) is before the fix dccd29f4 (#1916)"
    earlier = place("mlx-vlm", "570afed3", fixed_commit=V01_FIXED)
    assert earlier.fixed is None
    assert "the reproduction decides" in earlier.reason


def test_fix_from_side_branch_maps_to_merge() -> None:
    index = load_index("mlx-vlm")
    merge = index.mainline[position(index, "570afed3") or 0]
    assert merge is not None
    assert merge.startswith("c8d6057c")
    pos = position(index, merge)
    assert pos is not None
    assert index.contains(index.mainline[pos - 1], "570afed3") is False
    assert index.contains(merge, "570afed3") is True
    assert index.contains("dccd29f4", "570afed3") is True


def test_index_is_parsed_once_and_shared() -> None:
    """Each shipped index is parsed once per process and then shared (its cost belongs in a benchmark, not here)."""
    for dist in DISTRIBUTIONS:
        load_index.cache_clear()
        first = load_index(dist)
        assert first._position and first.mainline[-1] == first.head
        assert load_index(dist) is first
        assert load_index.cache_info().misses == 1
    load_index.cache_clear()


def test_does_not_import_mlx() -> None:
    code = (
        "import sys, kvpatch.commits as c\n"
        "c.place('mlx-vlm', 'f96138ee', fixed_commit='2a55b80b')\n"
        "bad = [m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_lm', 'mlx_vlm'))]\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


# -- scripts/build_commit_index.py -----------------------------------------------------------


def _git(repo: Path, *args: str, when: int = 0) -> str:
    stamp = f"{1_700_000_000 + when} +0000"
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
        "GIT_AUTHOR_DATE": stamp,
        "GIT_COMMITTER_DATE": stamp,
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    out = subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env)
    return out.stdout.strip()


def _build(repo: Path, out_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            str(BUILD_SCRIPT),
            "--mlx-lm",
            str(repo),
            "--mlx-vlm",
            str(repo),
            "--out-dir",
            str(out_dir),
            *list(extra),
        ],
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_build_script_on_synthetic_repo(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    n = 0

    def commit(msg: str) -> str:
        nonlocal n
        n += 1
        _git(repo, "commit", "-q", "--allow-empty", "-m", msg, when=n)
        return _git(repo, "rev-parse", "HEAD")

    m0 = commit("Initial commit")
    m1 = commit("Add a thing (#3)")
    _git(repo, "tag", "v0.1.0")
    _git(repo, "checkout", "-q", "-b", "side")
    s1 = commit("side work")
    _git(repo, "tag", "-a", "-m", "release", "v0.1.1")  # annotated tag on a side commit
    s2 = commit("more side work")
    _git(repo, "checkout", "-q", "main")
    m2 = commit("Fix another thing (#4)")
    _git(repo, "merge", "-q", "--no-ff", "-m", "Merge pull request #5 from someone/side", "side", when=n + 1)
    m3 = _git(repo, "rev-parse", "HEAD")
    _git(repo, "checkout", "-q", "-b", "unmerged", m1)
    u1 = commit("never merged")
    _git(repo, "tag", "v9.9.9")
    _git(repo, "checkout", "-q", "main")

    out = tmp_path / "out"
    res = _build(repo, out)
    assert res.returncode == 0, res.stderr
    text = (out / "commits-mlx-vlm.txt").read_text()
    assert text == (out / "commits-mlx-lm.txt").read_text().replace("mlx-lm", "mlx-vlm").replace(
        "github.com/ml-explore/", "github.com/Blaizzy/"
    )
    data = [line for line in text.splitlines() if not line.startswith("#")]
    assert data == [m0, f"{m1} #3 v0.1.0", f"{m2} #4", f"{m3} #5 v0.1.1", f"+{s1}", f"+{s2}"]
    assert f"# head: {m3}" in text
    assert "# branch: main" in text
    assert f"# tag v0.1.1: {s1} is on a side branch; written on main-line {m3}" in text
    assert f"# tag v9.9.9: {u1} is not reachable from main (it forks from main-line {m1}); omitted" in text

    index = CommitIndex.parse(text)
    assert index.head == m3
    assert position(index, s1) == 3
    assert index.contains(m2, s1) is False
    assert index.contains(m3, s1) is True

    # Deterministic: a rerun changes nothing, and --check agrees.
    assert _build(repo, out).returncode == 0
    assert (out / "commits-mlx-vlm.txt").read_text() == text
    assert _build(repo, out, "--check").returncode == 0
    commit("newer")
    assert _build(repo, out, "--check").returncode == 1


@pytest.mark.skipif(not all(p.is_dir() for p in MIRRORS.values()), reason="upstream mirrors not on this machine")
def test_shipped_index_matches_mirror(tmp_path: Path) -> None:
    res = subprocess.run(
        [
            sys.executable,
            str(BUILD_SCRIPT),
            "--mlx-lm",
            str(MIRRORS["mlx-lm"]),
            "--mlx-vlm",
            str(MIRRORS["mlx-vlm"]),
            "--out-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    for dist in DISTRIBUTIONS:
        fresh = CommitIndex.parse((tmp_path / f"commits-{dist}.txt").read_text())
        shipped = load_index(dist)
        if fresh.head != shipped.head:
            # The mirror moved on: the shipped main line must be a prefix of the new one.
            assert fresh.mainline[: len(shipped.mainline)] == shipped.mainline
            continue
        assert (tmp_path / f"commits-{dist}.txt").read_bytes() == (
            ROOT / "kvpatch" / "data" / f"commits-{dist}.txt"
        ).read_bytes()
