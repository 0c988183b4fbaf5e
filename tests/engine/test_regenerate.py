"""``python -m kvpatch.maint.regenerate``: one command rewrites the files derived from the units, and its
``--check`` names each stale one (and writes nothing)."""

from __future__ import annotations

import sys

import pytest
from support import REPO

from kvpatch import registry
from kvpatch.maint import regenerate


def test_check_names_stale_files_and_write_refreshes_them(tmp_path, monkeypatch, capsys):
    index, compat = tmp_path / "units.json", tmp_path / "COMPAT.md"
    monkeypatch.setattr(registry, "INDEX", index)
    monkeypatch.setattr(regenerate, "COMPAT", compat)
    index.write_text("{}\n")
    compat.write_text("# an old table\n")

    assert regenerate.main(["--check", "--no-fingerprints"]) == 1
    err = capsys.readouterr().err
    assert str(index) in err and str(compat) in err
    assert index.read_text() == "{}\n" and compat.read_text() == "# an old table\n"  # --check writes nothing

    assert regenerate.main(["--no-fingerprints", "--no-example"]) == 0
    assert regenerate.main(["--check", "--no-fingerprints"]) == 0
    assert '"units"' in index.read_text() and "## Patches" in compat.read_text()

    compat.write_text(compat.read_text() + "edited by hand\n")
    assert regenerate.main(["--check", "--no-fingerprints"]) == 1
    err = capsys.readouterr().err
    assert str(compat) in err and str(index) not in err


def test_fingerprints_step_runs_the_recording_script_for_the_named_patches():
    command = regenerate.fingerprints_command("offset-detach", check=True, git=False)
    assert command[:2] == [sys.executable, str(regenerate.FINGERPRINTS_SCRIPT)]
    assert command[2:] == ["--only", "offset-detach", "--no-git", "--check"]


def test_fingerprints_step_passes_offline_on():
    assert regenerate.fingerprints_command("", check=False, git=True, offline=True)[2:] == ["--offline"]


def test_help_says_what_downloads_and_how_not_to():
    """``--check`` says it downloads as writing does, and ``--offline`` that it downloads nothing."""
    text = " ".join(_help().split())
    assert "--check exit 1 naming each stale file; write nothing (downloads as writing does)" in text
    assert "--offline ask no package index, download nothing: use the cached layers only" in text
    assert "each step says which ones are not cached before it downloads them" in text


def _help() -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        regenerate.main(["--help"])
    return out.getvalue()


def _registry(monkeypatch, patches, broken=None):
    reg = registry.Registry(patches, broken or {})
    monkeypatch.setattr(registry, "load", lambda: reg)


def test_a_unit_that_does_not_load_stops_it_with_kvpatch_list_s_line(tmp_path, monkeypatch, capsys):
    """An open affected range (or any broken unit): the same line `kvpatch list` prints, no traceback, nothing
    written."""
    from kvpatch import cli
    from kvpatch.record import Expiry, Patch, RecordError

    with pytest.raises(RecordError) as raised:
        Patch(id="x", summary="s", distribution="mlx-lm", affected=">=0.32.0", reference="r", expiry=Expiry("e"))
    assert "affected='>=0.32.0' has no upper bound: end it at the newest release measured" in str(raised.value)
    _registry(monkeypatch, [], {"kvpatch.patches.mlx_lm.x": f"RecordError: {raised.value}"})
    monkeypatch.setattr(registry, "INDEX", tmp_path / "units.json")
    assert regenerate.main(["--no-fingerprints", "--no-example"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not (tmp_path / "units.json").exists()
    monkeypatch.setattr(cli, "load", registry.load)
    assert cli.main(["list"]) != 0
    (listed,) = [line for line in capsys.readouterr().err.splitlines() if "cannot be loaded" in line]
    assert listed in err.splitlines()


def test_an_empty_catalogue_stops_it_naming_the_file_and_field(monkeypatch, capsys):
    from kvpatch.record import Expiry, Patch

    patch = Patch(
        id="x", summary="s", distribution="mlx-lm", affected="<=0.1", checked_through="0.1", reference="r",
        expiry=Expiry("e"),
    )  # fmt: skip
    _registry(monkeypatch, [patch])
    assert regenerate.main(["--check", "--no-fingerprints"]) == 2
    assert "kvpatch/patches/mlx_lm/x.py: catalogue is empty: set catalogue=" in capsys.readouterr().err


def test_the_status_example_is_replaced_whole():
    doc = (REPO / "docs" / "status.md").read_text(encoding="utf-8")
    output = "kvpatch 9 on Python 3 (linux)\n56 patches: 56 applied\n"
    new = regenerate.with_example(doc, output)
    head, tail = doc.split("`kvpatch status --verify` printed:")[0], doc.split("\n```\n", 2)
    assert "```text\n" + output + "```\n" in new
    assert new.count("printed:") == doc.count("printed:") == 1
    before = doc[: doc.index("With ")]
    assert new.startswith(before) and new.endswith(doc[doc.index("\n```\n", doc.index("```text")) + 5 :])
    assert head and tail


def test_the_stale_message_names_one_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(registry, "INDEX", tmp_path / "units.json")
    monkeypatch.setattr(regenerate, "COMPAT", tmp_path / "COMPAT.md")
    assert regenerate.main(["--check", "--no-fingerprints", "--only", "offset-detach"]) == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("stale:")]
    assert line.endswith("run `python -m kvpatch.maint.regenerate --only offset-detach`")


@pytest.fixture
def script():
    """scripts/record_fingerprints.py as a module (it puts the clone on sys.path: put sys.path back)."""
    import importlib.util

    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location("record_fingerprints", REPO / "scripts" / "record_fingerprints.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def test_the_fingerprint_plan_says_what_it_downloads_and_offline_measures_the_rest(script, monkeypatch, capsys):
    monkeypatch.setattr(script.envs, "missing_layers", lambda requirements: (["mlx-lm==0.32.1"], 4_000_000, []))
    wanted = {("mlx-lm", "0.32.1"): [], ("mlx-lm", "0.32.2"): []}
    assert script.plan(wanted, offline=False) == set()
    err = " ".join(capsys.readouterr().err.split())
    assert "measuring 2 releases (mlx-lm 0.32.1, 0.32.2)" in err
    assert "downloading and installing 1 layers not cached (mlx-lm==0.32.1; about 4 MB under" in err
    assert script.plan(wanted, offline=True) == {("mlx-lm", "0.32.1")}
    assert "so mlx-lm 0.32.1 are not measured: run without --offline" in capsys.readouterr().err


def test_what_is_not_measured_keeps_its_recorded_fingerprints(script):
    old = {"p": {"t": {"aaa": ["0.1", "git:1234"], "bbb": ["git:5678"]}}}
    table = {"p": {"t": {"aaa": ["0.2"]}}}
    script._keep(table, old, "p", lambda label: label.startswith("git:"))  # no git history here
    assert table == {"p": {"t": {"aaa": ["0.2"], "bbb": ["git:5678"]}}}  # a release has aaa: no commit label for it
    script._keep(table, old, "p", lambda label: label == "0.1")  # offline: 0.1 was not measured
    assert table["p"]["t"]["aaa"] == ["0.2", "0.1"]


def test_offline_releases_are_the_matrix_s_the_cache_s_and_the_recorded_ones(script, monkeypatch):
    monkeypatch.setattr(script.envs, "cached_versions", lambda dist: ["0.32.1"])
    recorded = {"p": {"t": {"aaa": ["0.29.1", "git:1234"]}}}
    found = [str(v) for v in script.known_versions("mlx-lm", recorded)]
    assert {"0.29.1", "0.32.1", "0.32.2", "0.22.0"} <= set(found) and found == sorted(found, key=script.Version)
