"""The ``kvpatch`` console script: exit codes, closed pipes, working-directory shadowing, broken upstream
metadata, and the runtime never importing maintainer code. Each runs the installed script in a fresh
process from a scratch directory, the way an operator or a health check runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO, child_env

from kvpatch import cli

SCRIPT = Path(sys.executable).parent / "kvpatch"


def _run(args, *, cwd, env=None, timeout=300):
    return subprocess.run(
        [str(SCRIPT), *args], cwd=cwd, env=child_env(env), capture_output=True, text=True, timeout=timeout
    )


def test_console_script_is_installed():
    assert SCRIPT.is_file(), f"no console script at {SCRIPT}: [project.scripts] kvpatch is missing"


# -- exit codes -------------------------------------------------------------------------------------------


def test_exit_codes_are_distinct_and_documented_in_status_help(tmp_path):
    codes = [code for code, _ in cli.EXIT_CODES]
    assert len(set(codes)) == len(codes)
    assert (cli.EXIT_CLEAN, cli.EXIT_ATTENTION, cli.EXIT_FAILED) == (0, 1, 2)
    assert cli.EXIT_INTERNAL not in (0, 1, 2) and cli.EXIT_USAGE not in (0, 1, 2)
    proc = _run(["status", "--help"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for code, meaning in cli.EXIT_CODES:
        assert f"  {code:<4} {meaning}" in proc.stdout, (code, proc.stdout)


def test_exit_codes_are_documented_in_the_docs():
    text = (REPO / "docs" / "status.md").read_text()
    for code, _ in cli.EXIT_CODES:
        assert f"\n| {code} |" in text, f"docs/status.md's exit-code table lacks {code}"


def test_launcher_and_cli_agree_on_the_internal_error_code():
    import _kvpatch_cli

    assert _kvpatch_cli.EXIT_INTERNAL == cli.EXIT_INTERNAL


@pytest.mark.parametrize("args", [["status", "--bogus"], [], ["no-such-command"], ["status", "--check", "x"]])
def test_usage_errors_exit_64_not_2(tmp_path, args):
    proc = _run(args, cwd=tmp_path)
    assert proc.returncode == cli.EXIT_USAGE, (proc.returncode, proc.stderr)
    assert "usage:" in proc.stderr and "Traceback" not in proc.stderr


def test_internal_error_exits_70_with_the_traceback(monkeypatch, capsys):
    import kvpatch.status

    def boom(*args, **kwargs):
        raise RuntimeError("simulated bug in kvpatch")

    monkeypatch.setattr(kvpatch.status, "build_report", boom)
    assert cli.main(["status", "--check"]) == cli.EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "Traceback" in err and "simulated bug in kvpatch" in err and "internal error (exit 70)" in err


def test_a_kvpatch_that_cannot_be_imported_exits_70(tmp_path):
    broken = tmp_path / "site"
    (broken / "kvpatch").mkdir(parents=True)
    (broken / "kvpatch" / "__init__.py").write_text("raise ImportError('simulated broken install')\n")
    proc = _run(["status", "--check"], cwd=tmp_path, env={"PYTHONPATH": str(broken)})
    assert proc.returncode == cli.EXIT_INTERNAL, (proc.returncode, proc.stdout, proc.stderr)
    assert "cannot be imported" in proc.stderr and "simulated broken install" in proc.stderr


# -- closed pipe -------------------------------------------------------------------------------------------


def test_reader_gone_before_the_first_write_is_quiet(tmp_path):
    """stdout closed before kvpatch writes anything: every write meets EPIPE; no traceback, exit 0."""
    proc = subprocess.Popen(
        [str(SCRIPT), "status", "--json"],
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err


@pytest.mark.parametrize("args", [["status", "--json"], ["status", "-v"], ["status", "--check"]])
def test_head_one(tmp_path, args):
    """`kvpatch status --json | head -1` under pipefail: exit 0, nothing on stderr but kvpatch's warnings."""
    command = f"set -o pipefail; '{SCRIPT}' {' '.join(args)} | head -1"
    proc = subprocess.run(
        ["bash", "-c", command], cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 1
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


# -- the working directory never shadows the installed kvpatch ------------------------------------------


def test_console_script_is_not_shadowed_by_the_working_directory(tmp_path):
    (tmp_path / "kvpatch").mkdir()
    (tmp_path / "kvpatch" / "__init__.py").write_text("print('SHADOWED'); raise SystemExit(99)\n")
    proc = _run(["status", "--json"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["schema"] == "kvpatch.status/1"
    # what the README used to run: `python -m kvpatch` imports the working directory's copy
    shadowed = subprocess.run(
        [sys.executable, "-m", "kvpatch", "status"], cwd=tmp_path, env=child_env(), capture_output=True, text=True
    )
    assert "SHADOWED" in shadowed.stdout and shadowed.returncode == 99


# -- missing, empty, non-UTF-8 upstream METADATA ---------------------------------------------------------


def _fake_mlx_lm(root: Path, metadata: bytes | None) -> Path:
    """An importable ``mlx_lm`` whose .dist-info has ``metadata`` as METADATA (``None``: no METADATA)."""
    (root / "mlx_lm").mkdir(parents=True)
    (root / "mlx_lm" / "__init__.py").write_text("")
    info = root / "mlx_lm-0.32.2.dist-info"
    info.mkdir()
    if metadata is not None:
        (info / "METADATA").write_bytes(metadata)
    return root


METADATA_CASES = {
    "missing": (None, "METADATA missing"),
    "empty": (b"", "METADATA empty"),
    "non-utf8": (b"Metadata-Version: 2.1\nName: mlx-lm\nVersion: 0.32.2\nSummary: \xff\xfe\n", "METADATA unreadable"),
}


@pytest.mark.parametrize("case", list(METADATA_CASES))
def test_unreadable_metadata_is_installed_version_unknown(tmp_path, case):
    metadata, why = METADATA_CASES[case]
    env = {"PYTHONPATH": str(_fake_mlx_lm(tmp_path / "site", metadata))}
    # --no-settle: the stand-in package has no submodules to import, so settling would (rightly) say failed
    proc = _run(["status", "--json", "--check", "--no-settle"], cwd=tmp_path, env=env)
    assert proc.returncode in (0, 1, 2), proc.stderr  # an outcome, not a crash (70) or a traceback
    assert "Traceback" not in proc.stderr
    data = json.loads(proc.stdout)
    assert proc.returncode == data["check"]["exit"]
    up = data["upstream"]["mlx-lm"]
    assert up["installed"] is True and up["version"] is None and up["version_unknown"].startswith(why)
    lm = [p for p in data["patches"] if p["distribution"] == "mlx-lm"]
    # (an opt-in patch says "opt-in" instead of "verify": it stays off until KVPATCH_ENABLE names it)
    assert lm and all(p["action"] in ("verify", "opt-in") and p["state"] != "not installed" for p in lm), lm
    assert all("installed, version unknown" in p["reason"] for p in lm)

    text = _run(["status", "--no-settle"], cwd=tmp_path, env=env)
    assert text.returncode == 0 and "Traceback" not in text.stderr
    assert "mlx-lm (version unknown)" in text.stdout and f"mlx-lm: installed, version unknown ({why}" in text.stdout
    assert "pending verification" in text.stdout and "not installed: its" not in text.stdout


@pytest.mark.parametrize("case", list(METADATA_CASES))
def test_records_and_require_applied_survive_unreadable_metadata(tmp_path, case):
    metadata, _ = METADATA_CASES[case]
    code = (
        "import json, kvpatch\n"
        "states = {st.patch.id: st.state.value for st in kvpatch.records()}\n"
        "try:\n"
        "    applied = [st.patch.id for st in kvpatch.require_applied()]\n"
        "except kvpatch.NotApplied as exc:  # version unknown: what the reproduction decides is not in yet\n"
        "    applied = ['NotApplied: ' + p.state for p in exc.problems]\n"
        "print(json.dumps({'states': states, 'applied': applied}))\n"
    )
    env = child_env({"PYTHONPATH": str(_fake_mlx_lm(tmp_path / "site", metadata))})
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["states"] and "UnicodeDecodeError" not in proc.stderr


# -- the runtime imports no maintainer code ----------------------------------------------------------------


def test_status_imports_no_maintainer_code(tmp_path):
    code = (
        "import contextlib, io, sys\n"
        "import kvpatch\n"
        "after_import = sorted(m for m in sys.modules if m.startswith('kvpatch.maint'))\n"
        "from kvpatch.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    for args in (['status'], ['status', '-v'], ['status', '--json'], ['status', '--check'], ['--help']):\n"
        "        try:\n"
        "            main(args)\n"
        "        except SystemExit:\n"
        "            pass\n"
        "print(after_import, sorted(m for m in sys.modules if m.startswith('kvpatch.maint')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=child_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[] []"


def test_enforce_reads_expiry_lazily(tmp_path):
    """KVPATCH_ENFORCE=1 (kvpatch's own CI) adds expiry facts; the maintainer module loads only then."""
    proc = _run(["status", "--check"], cwd=tmp_path, env={"KVPATCH_ENFORCE": "1"})
    assert proc.returncode in (0, 1, 2) and "Traceback" not in proc.stderr, proc.stderr


def test_maintainer_commands_still_load_their_modules(tmp_path):
    proc = _run(["upstream-check", "--help"], cwd=tmp_path)
    assert proc.returncode == 0 and "--mlx-lm" in proc.stdout, proc.stderr
    proc = _run(["compat", "--path", str(REPO / "COMPAT.md"), "--check"], cwd=tmp_path)
    assert proc.returncode in (0, 1) and "COMPAT.md" in proc.stdout + proc.stderr, proc.stderr


@pytest.mark.skipif(os.name != "posix", reason="POSIX shells")
def test_status_help_mentions_the_schema(tmp_path):
    proc = _run(["status", "--help"], cwd=tmp_path)
    assert "status.schema.json" in proc.stdout


def test_settled_outcome_does_not_outlive_a_verification(tmp_path, monkeypatch):
    """``status`` caches its settled outcome per environment; a ``kvpatch verify`` since then (new verdicts)
    changes what an import does, so it must change the cache key (it did not: status went on saying
    "pending verification" after a successful verify)."""
    from kvpatch import settle, verdicts
    from kvpatch.engine import Engine

    monkeypatch.setenv("KVPATCH_VERDICTS", str(tmp_path))
    engine = Engine([], upstream={})
    before = settle.environment_key(engine)
    entry = {"patch": "p", "outcome": "fixed", "detail": "", "at": 0, "by": "verify"}
    (tmp_path / verdicts.FILE).write_text(json.dumps({"schema": verdicts.SCHEMA, "verdicts": {"k": entry}}))
    verdicts._forget()
    assert settle.environment_key(engine) != before
