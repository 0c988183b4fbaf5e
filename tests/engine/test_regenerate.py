"""``python -m kvpatch.maint.regenerate``: one command rewrites the files derived from the units, and its
``--check`` names each stale one (and writes nothing)."""

from __future__ import annotations

import sys

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

    assert regenerate.main(["--no-fingerprints"]) == 0
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
