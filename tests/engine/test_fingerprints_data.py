"""The shipped drift fingerprints (``kvpatch/data/fingerprints.json``, written by ``scripts/record_fingerprints.py``).

Every patch that applies somewhere in the test matrix must carry the fingerprint of each replaced target on
each release of its affected range that the matrix runs: without them the engine cannot tell drifted target
code (an editable install, a vendor's patched wheel) from the code the patch was validated on.
"""

from __future__ import annotations

import json

import pytest
from matrix import BUCKETS

from kvpatch import fingerprints, registry
from kvpatch.record import Kind

DATA = fingerprints.SHIPPED
PATCHES = registry.load().patches


def _in_range_releases(patch) -> list[str]:
    found = set()
    for bucket in BUCKETS:
        version = bucket.version(patch.distribution)
        if version and patch.range.contains(version, prereleases=True):
            found.add(version)
    return sorted(found)


def test_data_file_is_well_formed():
    data = json.loads(DATA.read_text())
    assert data["schema"] == "kvpatch.fingerprints/1"
    known = {p.id for p in PATCHES}
    assert set(data["patches"]) <= known, set(data["patches"]) - known
    for pid, targets in data["patches"].items():
        for path, fps in targets.items():
            assert fps, (pid, path)
            for fp, labels in fps.items():
                assert len(fp) == 12 and all(c in "0123456789abcdef" for c in fp), (pid, path, fp)
                assert labels and all(isinstance(x, str) for x in labels), (pid, path, fp)
    # what the engine reads
    table = fingerprints.shipped()
    assert set(table) == set(data["patches"])


@pytest.mark.parametrize("patch", PATCHES, ids=[p.id for p in PATCHES])
def test_applying_patch_has_fingerprints_for_every_target(patch):
    releases = _in_range_releases(patch)
    if not releases:
        pytest.skip(f"{patch.id}: no matrix bucket in {patch.affected}")
    data = json.loads(DATA.read_text())["patches"].get(patch.id, {})
    missing = []
    for target in patch.targets:
        if target.kind is not Kind.REPLACE:
            continue
        recorded = data.get(target.path, {})
        labels = {label for fps in recorded.values() for label in fps}
        if target.optional and not recorded:
            continue  # absent on every release of the range: nothing to fingerprint
        lacking = [r for r in releases if r not in labels]
        if lacking and not target.optional:
            missing.append(f"{target.path}: no fingerprint for {patch.distribution} {', '.join(lacking)}")
    assert not missing, "run python -m kvpatch.maint.regenerate --only " + patch.id + ":\n" + "\n".join(missing)
