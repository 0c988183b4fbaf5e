"""A new patch unit (``python -m kvpatch.maint.new``, CONTRIBUTING.md "Adding a patch"): the scaffold writes a unit
and a test that load, lint and name what is left to write; the unit tier fails, naming each, while any is left; every
record passes the maintainer checks (no blank COMPAT.md cell)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest
from support import REPO

from kvpatch import registry
from kvpatch.maint import new
from kvpatch.record import Expiry, Patch

RUFF = shutil.which("ruff")
TRIM = "mlx_lm.models.cache.KVCache.trim"
#: What the scaffold reads a method's signature from: a release's module, as a layer holds it.
CACHE_PY = """
class _BaseCache:
    def trim(self, n, *, keep=0):
        return n

class KVCache(_BaseCache):
    @property
    def state(self):
        return None
"""


# -- the catalogue as it is ----------------------------------------------------------------------------------------


def test_no_unit_or_patch_test_is_still_a_scaffold_stub():
    left = new.unfinished(REPO)
    assert not left, f"write what each {new.STUB} line asks (python -m kvpatch.maint.new left them):\n" + "\n".join(
        left
    )


def test_every_record_passes_the_maintainer_checks():
    found = [f"{p.module}: {problem}" for p in registry.load().patches for problem in new.record_problems(p)]
    assert not found, "\n".join(found)


def test_an_empty_catalogue_is_refused_by_name():
    patch = Patch(
        id="x", summary="s", distribution="mlx-lm", affected="<=0.1", checked_through="0.1", reference="r",
        expiry=Expiry("never"),
    )  # fmt: skip
    (problem,) = new.record_problems(patch)
    assert problem.startswith("catalogue is empty: set catalogue=")


# -- the scaffold --------------------------------------------------------------------------------------------------


@pytest.fixture
def clone(tmp_path, monkeypatch):
    """A clone's skeleton for the scaffold to write into, and a cached mlx-lm layer to read targets from."""
    root = tmp_path / "clone"
    for folder in ("scripts", "tests/upstream", "kvpatch/patches/mlx_lm", "kvpatch/patches/mlx_vlm"):
        (root / folder).mkdir(parents=True)
    (root / "scripts" / "record_fingerprints.py").write_text("")
    shutil.copy(REPO / "pyproject.toml", root)  # ruff's settings, as the tree's lint test has them
    (root / "CHANGELOG.md").write_text("# Changelog\n\n## [Unreleased]\n\n### Fixed\n\n- x\n\n## [0.1.0]\n\n- y\n")
    layer = tmp_path / "layer"
    (layer / "mlx_lm" / "models").mkdir(parents=True)
    (layer / "mlx_lm" / "models" / "cache.py").write_text(CACHE_PY)
    monkeypatch.setattr(new, "REPO", root)
    monkeypatch.setattr(registry, "load", lambda: registry.Registry([], {}))  # the ids this clone's units take
    monkeypatch.setattr(new, "_roots", lambda *a, **k: [("mlx-lm 0.32.2", layer)])
    return root


def _scaffold(*extra: str) -> int:
    return new.main(
        ["kvcache-trim-demo", "--package", "mlx-lm", "--affected", ">=0.32.0,<=0.32.2", "--target", TRIM,
         "--summary", "KVCache.trim(n) does something wrong " + "at length " * 12, "--catalogue", "issue 37 demo",
         "--no-regenerate", *extra]
    )  # fmt: skip


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_scaffold_writes_a_unit_and_a_test_that_load_and_name_what_is_left(clone, capsys):
    assert _scaffold() == 0
    unit = clone / "kvpatch" / "patches" / "mlx_lm" / "kvcache_trim_demo.py"
    test = clone / "tests" / "upstream" / "test_kvcache_trim_demo.py"
    assert unit == new.unit_path("kvcache-trim-demo", "mlx-lm", clone)  # the layout rule (registry.module_for)
    patch = _load(unit, "kvcache_trim_demo_unit").PATCH
    assert (patch.id, patch.affected, patch.checked_through, patch.catalogue) == (
        "kvcache-trim-demo", ">=0.32.0,<=0.32.2", "0.32.2", "issue 37 demo",
    )  # fmt: skip
    assert [t.path for t in patch.targets] == [TRIM] and not new.record_problems(patch)
    # the builder takes what the original takes (read from the release: inherited, keyword-only default) and calls it
    original = []
    replacement = patch.builders[patch.targets[0]](lambda *a, **k: original.append((a, k)) or "r")
    assert replacement("self", 3, keep=1) == "r" and original == [(("self", 3), {"keep": 1})]
    finding = patch.reproduction()
    assert finding.inconclusive and new.STUB in finding.inconclusive  # the regression test fails, saying why
    assert "pytestmark = pytest.mark.requires_patch(PATCH.id)" in test.read_text()
    assert 'pytest.fail("' + new.STUB in test.read_text()
    left = new.unfinished(clone)
    assert {line.split(":")[0] for line in left} == {str(unit.relative_to(clone)), str(test.relative_to(clone))}
    assert any("write the reproduction" in line for line in left) and any("write the fix" in line for line in left)
    out = capsys.readouterr().out
    assert f"({len(left)} left)" in out and all(line in out for line in left)
    changelog = (clone / "CHANGELOG.md").read_text()
    assert (
        "### Fixed\n\n- x\n\n### Added\n\n- Patch `kvcache-trim-demo` (catalogue issue 37 demo): KVCache" in changelog
    )
    assert changelog.endswith("\n## [0.1.0]\n\n- y\n")


def test_the_changelog_line_goes_first_under_unreleased_added():
    patch = Patch(
        id="x-demo", summary="s", catalogue="c", distribution="mlx-lm", affected="<=0.1", checked_through="0.1",
        reference="r", expiry=Expiry("never"),
    )  # fmt: skip
    text = (REPO / "CHANGELOG.md").read_text()
    changed = new.with_changelog_entry(text, patch)
    unreleased = changed[: changed.index("\n## [", changed.index("## [Unreleased]") + 1)]
    assert "### Added\n\n- Patch `x-demo` (catalogue c): s.\n- " in unreleased
    assert changed.replace("- Patch `x-demo` (catalogue c): s.\n", "", 1) == text


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed")
def test_the_scaffold_output_is_ruff_clean(clone):
    assert _scaffold() == 0
    files = [str(p) for p in (*clone.rglob("kvcache_trim_demo.py"), *clone.rglob("test_kvcache_trim_demo.py"))]
    for args in (["check", "--no-cache"], ["format", "--check", "--no-cache"]):
        proc = subprocess.run([RUFF, *args, *files], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_target_the_release_lacks_gets_a_plain_builder(clone, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["x"])
    assert new.main(
        ["tq-demo", "--package", "mlx-lm", "--affected", "<0.32.0", "--fixed-in", "0.32.0", "--target",
         "mlx_lm.models.cache.KVCache.state", "--target", "mlx_lm.models.cache.Missing.f", "--summary", "s",
         "--catalogue", "c", "--no-regenerate"]
    ) == 0  # fmt: skip
    assert "has no Missing.f in mlx_lm.models.cache" in capsys.readouterr().err
    patch = _load(clone / "kvpatch" / "patches" / "mlx_lm" / "tq_demo.py", "tq_demo_unit").PATCH
    assert (patch.fixed_in, patch.checked_through) == ("0.32.0", None)
    assert "0.32.0" in patch.expiry.condition
    for target in patch.targets:  # a property, a missing name: the builder starts by declining
        assert patch.builders[target]("orig") == "orig"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--affected", ">=0.32.0"], "affected='>=0.32.0' has no upper bound"),
        (["--affected", "<0.32.0"], "needs checked_through (the newest release measured) (--checked-through"),
        (["--affected", "<=0.32.2", "--target", "numpy.f"], "outside mlx_lm / mlx_vlm"),
    ],
)
def test_the_scaffold_refuses_a_record_the_engine_would_refuse(clone, capsys, args, said):
    argv = ["x-demo", "--package", "mlx-lm", "--target", TRIM, "--summary", "s", "--catalogue", "c", *args]
    assert new.main([*argv, "--no-regenerate"]) == 64
    assert said in capsys.readouterr().err
    assert not list((clone / "kvpatch" / "patches" / "mlx_lm").iterdir())  # nothing written


def test_the_scaffold_refuses_an_existing_unit(clone, capsys):
    assert _scaffold() == 0
    assert _scaffold() == 64
    assert "exists already" in capsys.readouterr().err


def test_the_scaffold_runs_only_in_a_clone(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(new, "REPO", tmp_path)
    assert _scaffold() == 2
    assert "not a clone of kvpatch" in capsys.readouterr().err
