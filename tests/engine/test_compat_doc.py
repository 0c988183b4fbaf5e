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


def test_readme_status_example_lists_every_patch():
    """The README's `status` example must show the registry as it is (regenerate it when patches change)."""
    import re

    from kvpatch.registry import load

    text = (REPO / "README.md").read_text()
    start = text.index("`python -m kvpatch status --verify` printed:")
    block = text[start : text.index("\n```\n", text.index("```text", start))]
    shown = set(
        re.findall(r"^([a-z0-9-]+)\s+(?:applied|not needed|pending|out of range|disabled|drifted|failed)", block, re.M)
    )
    assert shown == {p.id for p in load().patches}
