"""kvpatch.versions (plain releases and ranges without packaging, for the start-up path) gives packaging's answers."""

from __future__ import annotations

import itertools

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kvpatch import registry, versions

PLAIN = [
    "0", "0.0", "0.1", "0.22.0", "0.22", "0.23.2", "0.24.0", "0.28.4", "0.30.4", "0.31.3", "0.32", "0.32.0",
    "0.32.2", "0.32.10", "0.4.3", "0.6.4", "0.6.15", "0.6.16", "0.7.10", "0.7.100", "1", "1.0.0", "2.0", "10.0",
]  # fmt: skip
NOT_PLAIN = ["0.32.3.dev0", "0.32.3.dev0+g1234abc", "0.7.10rc1", "0.7.10.post1", "1!0.1", "0.32.2+local", "01.2"]
RANGES = [">=0.22.0,<0.24.0", ">=0.6.4,<=0.7.10", "==0.32.2", "!=0.32.0,<0.33", ">0.30,<0.31.3", "<1"]


def test_release_orders_as_packaging():
    for a, b in itertools.product(PLAIN, repeat=2):
        ra, rb = versions.release(a), versions.release(b)
        va, vb = Version(a), Version(b)
        assert (ra < rb, ra <= rb, ra == rb, ra >= rb, ra > rb) == (va < vb, va <= vb, va == vb, va >= vb, va > vb)
        assert str(ra) == str(va) and ra.release == va.release


def test_only_canonical_plain_releases_are_plain():
    assert all(versions.release(v) is None for v in NOT_PLAIN)
    assert all(isinstance(versions.parse(v), Version) for v in NOT_PLAIN)
    with pytest.raises(ValueError):
        versions.parse("not a version")


@pytest.mark.parametrize("spec", RANGES)
def test_simple_ranges_contain_what_packaging_contains(spec):
    light = versions.parse_range(spec)
    assert light is not None
    full = SpecifierSet(spec)
    for v in PLAIN + NOT_PLAIN[:-1]:
        assert light.contains(v, prereleases=True) == full.contains(v, prereleases=True), v
        assert light.contains(versions.parse(v), prereleases=True) == full.contains(Version(v), prereleases=True), v
        for clause in light:
            assert clause.contains(v, prereleases=True) == SpecifierSet(str(clause)).contains(v, prereleases=True)


@pytest.mark.parametrize("spec", ["~=0.6", ">=0.6.dev0", "==0.6.*", "===0.6", ">=1!0.6", ">=0.6,", "", "0.6"])
def test_anything_else_goes_to_packaging(spec):
    assert versions.parse_range(spec) is None


def test_every_record_range_matches_packaging():
    for patch in registry.load().patches:
        full = SpecifierSet(patch.affected)
        for v in PLAIN + NOT_PLAIN[:-1] + [patch.fixed_in or "0", patch.checked_through or "0"]:
            assert patch.range.contains(versions.parse(v), prereleases=True) == full.contains(
                Version(v), prereleases=True
            ), (patch.id, v)


def test_records_and_the_gate_do_not_import_packaging(run_py):
    out = run_py(
        "import sys\n"
        "from kvpatch import registry, gate\n"
        "from kvpatch.config import Config\n"
        "from kvpatch.detect import Source, Upstream\n"
        "up = Upstream('mlx-lm', '0.32.2', Source('index'), location='/x')\n"
        "[gate.decide(p.resolve(), up, Config()) for p in registry.index() if p.distribution == 'mlx-lm']\n"
        "print(sorted(m for m in sys.modules if m.startswith('packaging')))\n",
        env={"KVPATCH": "off"},
    )
    assert out.strip() == "[]", out


@pytest.mark.parametrize(
    ("affected", "fixed_in", "installed", "action"),
    [
        ("~=0.31.0", "0.32.0", "0.31.3", "APPLY"),  # a range packaging must read, a plain installed release
        ("~=0.31.0", "0.32.0", "0.30.4", "VERIFY"),  # below ~= is not read as a lower bound (as before)
        (">=0.31.0,<0.32.0", "0.32.0", "0.31.3", "APPLY"),  # plain both ways
        (">=0.31.0,<0.32.0", "0.32.0", "0.32.0rc1", "VERIFY"),  # a pre-release of the fix: packaging
        (">=0.31.0,<0.32.0", "0.32.0", "0.31.3+local", "APPLY"),
        (">=0.31.0,<0.32.0", "0.32.0", "0.33.0", "NOT_NEEDED"),
    ],
)
def test_gate_mixes_plain_and_packaging(affected, fixed_in, installed, action):
    from support import synthetic_patch

    from kvpatch.config import Config
    from kvpatch.detect import Source, Upstream
    from kvpatch.gate import Action, decide

    patch = synthetic_patch("mixed", affected=affected, fixed_in=fixed_in)
    decision = decide(patch, Upstream("mlx-lm", installed, Source(), location="/x"), Config())
    assert decision.action is Action[action], decision
