"""COMPAT.md is generated from the registry; it must not go stale."""

from __future__ import annotations

from support import REPO

from kvpatch.compat import render


def test_compat_md_is_current():
    current = (REPO / "COMPAT.md").read_text()
    assert current == render(), "COMPAT.md is stale: run `python -m kvpatch compat --write`"


def test_tested_releases_match_the_matrix():
    from matrix import BUCKETS

    from kvpatch.compat import TESTED

    for dist, releases in TESTED.items():
        in_matrix = {
            b.name.split("-", 1)[1] for b in BUCKETS if b.name.startswith("lm-" if dist == "mlx-lm" else "vlm-")
        }
        assert set(releases) == in_matrix, dist
