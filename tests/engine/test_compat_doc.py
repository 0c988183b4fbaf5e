"""COMPAT.md is generated from the registry; it must not go stale."""

from __future__ import annotations

from support import REPO

from kvpatch.maint.compat import render


def test_compat_md_is_current():
    current = (REPO / "COMPAT.md").read_text()
    assert current == render(), "COMPAT.md is stale: run `python -m kvpatch.maint.regenerate`"


def test_one_source_for_the_release_matrix():
    """COMPAT.md's release tables, the expiry floor and the tests' buckets all come from kvpatch.maint.matrix."""
    import matrix

    from kvpatch.maint import compat, expiry
    from kvpatch.maint import matrix as source

    assert matrix.BUCKETS is source.BUCKETS
    assert compat.TESTED is source.TESTED and expiry.SUPPORTED_FLOOR is source.SUPPORTED_FLOOR
    for dist, releases in source.TESTED.items():
        prefix = "lm-" if dist == "mlx-lm" else "vlm-"
        assert list(releases) == [b.name.removeprefix(prefix) for b in source.BUCKETS if b.name.startswith(prefix)]


def test_status_example_names_only_patches_of_the_catalogue():
    """docs/status.md's example is a snapshot of `kvpatch status --verify` that a whole `python -m
    kvpatch.maint.regenerate` refreshes (a new patch's `--only` run leaves it): it names no patch the catalogue lacks
    and counts no more patches than there are."""
    import re

    from kvpatch.registry import load

    ids = {p.id for p in load().patches}
    text = (REPO / "docs" / "status.md").read_text()
    start = text.index("`kvpatch status --verify` printed:")
    block = text[start : text.index("\n```\n", text.index("```text", start))]
    again = "run `python -m kvpatch.maint.regenerate` (a whole regeneration refreshes the example)"
    count = re.search(r"^(\d+) patches: ", block, re.M)
    assert count, "the example has no summary line"
    assert int(count.group(1)) <= len(ids), f"the example counts patches the catalogue no longer has: {again}"
    shown = set(re.findall(r"^  ([a-z0-9-]+)  ", block, re.M))
    assert shown and shown <= ids, f"the example shows patches the catalogue lacks, {sorted(shown - ids)}: {again}"
