"""The ``kvpatch`` console script: exit codes, closed pipes, working-directory shadowing, broken upstream
metadata, and the runtime never importing maintainer code. Each runs the installed script in a fresh
process from a scratch directory, the way an operator or a health check runs it."""

from __future__ import annotations

import json
import os
import re
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


@pytest.mark.parametrize("args", [["status", "--bogus"], ["no-such-command"], ["status", "--check", "x"]])
def test_usage_errors_exit_64_not_2(tmp_path, args):
    proc = _run(args, cwd=tmp_path)
    assert proc.returncode == cli.EXIT_USAGE, (proc.returncode, proc.stderr)
    assert "usage:" in proc.stderr and "Traceback" not in proc.stderr


def test_a_bad_option_gets_its_commands_usage(tmp_path):
    proc = _run(["status", "--bogus"], cwd=tmp_path)
    assert proc.returncode == cli.EXIT_USAGE
    assert proc.stderr.startswith("usage: kvpatch status [-h]"), proc.stderr
    assert "kvpatch status: error: unrecognized arguments: --bogus" in proc.stderr and "COMMAND" not in proc.stderr


@pytest.mark.parametrize(("typo", "meant"), [("stauts", "status"), ("verfy", "verify"), ("lsit", "list")])
def test_unknown_command_gets_a_suggestion(tmp_path, typo, meant):
    proc = _run([typo], cwd=tmp_path)
    assert proc.returncode == cli.EXIT_USAGE and proc.stdout == ""
    assert f"kvpatch: error: unknown command {typo!r} - did you mean {meant!r}?" in proc.stderr, proc.stderr
    far = _run(["zzzz"], cwd=tmp_path)
    assert far.returncode == cli.EXIT_USAGE and "did you mean" not in far.stderr and "kvpatch help" in far.stderr


@pytest.mark.parametrize(("typo", "meant"), [(["status", "--chek"], "--check"), (["verify", "--mising"], "--missing")])
def test_a_misspelt_option_gets_a_suggestion(tmp_path, typo, meant):
    proc = _run(typo, cwd=tmp_path)
    assert proc.returncode == cli.EXIT_USAGE and proc.stdout == ""
    assert f"unrecognized arguments: {typo[-1]} - did you mean {meant!r}?" in proc.stderr, proc.stderr
    far = _run(["status", "--zzzzzz"], cwd=tmp_path)
    assert far.returncode == cli.EXIT_USAGE and "did you mean" not in far.stderr, far.stderr


#: Runs the console script's entry point in this process with the arguments given, then says whether kvpatch built
#: its engine or registered an import hook: what activation does.
ACTIVATED = """
import json, sys, _kvpatch_cli
sys.argv = ["kvpatch", *sys.argv[1:]]
code = _kvpatch_cli.main()
import kvpatch
hooks = sys.modules.get("_kvpatch_hooks")
print(json.dumps({"exit": code, "engine": kvpatch._engine is not None, "hooked": sorted(getattr(hooks, "_also", ()))}))
"""


@pytest.mark.parametrize(
    ("args", "code"), [(["--version"], 0), (["-V"], 0), (["help"], 0), (["help", "status"], 0), (["--help"], 0),
                       (["stauts"], 64), (["status", "--chek"], 64), (["list"], 0)]
)  # fmt: skip
def test_the_command_line_parses_before_it_activates(tmp_path, args, code):
    """Activation (the engine, its hooks on upstream's modules) waits for the arguments: a command that needs no
    patch (the version, the help, a usage error, the list) activates nothing."""
    proc = subprocess.run(
        [sys.executable, "-c", ACTIVATED, *args], cwd=tmp_path, env=child_env(), capture_output=True, text=True
    )
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == {"exit": code, "engine": False, "hooked": []}, (out, proc.stderr)
    status = subprocess.run(
        [sys.executable, "-c", ACTIVATED, "status", "--no-settle"], cwd=tmp_path, env=child_env(), capture_output=True,
        text=True,
    )  # fmt: skip
    assert json.loads(status.stdout.splitlines()[-1])["engine"], status.stderr  # a command that needs it activates


def test_python_m_kvpatch_parses_before_it_activates(tmp_path):
    """``python -m kvpatch``: runpy imports the package to find ``__main__``; that import activates nothing."""
    code = "import sys; sys.orig_argv = [sys.executable, '-m', 'kvpatch', '-V']; sys.argv = ['-m']; import kvpatch; "
    code += "print(kvpatch._engine is None)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=child_env(), capture_output=True, text=True)
    assert proc.stdout.split() == ["True"], proc.stderr
    other = code.replace("'kvpatch', '-V'", "'mlx_lm.server'")  # another module run with -m: kvpatch activates
    proc = subprocess.run([sys.executable, "-c", other], cwd=tmp_path, env=child_env(), capture_output=True, text=True)
    assert proc.stdout.split() == ["False"], proc.stderr
    real = subprocess.run(
        [sys.executable, "-m", "kvpatch", "-V"], cwd=tmp_path, env=child_env(), capture_output=True, text=True
    )
    assert real.returncode == 0 and real.stdout.startswith("kvpatch "), real.stderr


# -- help, version, list -----------------------------------------------------------------------------------


def _help_sections(text: str) -> dict[str, list[str]]:
    """``{section title: [command or option names]}`` of a help text."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = sections.setdefault(line[:-1], [])
        elif current is not None and line.startswith("  ") and not line.startswith("   "):
            current.append(line.split()[0].rstrip(","))
    return sections


def test_bare_kvpatch_prints_the_help_and_exits_0(tmp_path):
    """As pip does (a help request, not an error); ``python -m kvpatch`` the same."""
    bare = _run([], cwd=tmp_path)
    assert bare.returncode == 0 and bare.stderr == "", bare.stderr
    for args in (["--help"], ["help"], ["-h"]):
        assert _run(args, cwd=tmp_path).stdout == bare.stdout, args
    module = subprocess.run(
        [sys.executable, "-m", "kvpatch"], cwd=tmp_path, env=child_env(), capture_output=True, text=True
    )
    assert module.returncode == 0 and module.stdout == bare.stdout, module.stderr


def test_help_groups_maintainer_commands_apart(tmp_path):
    sections = _help_sections(_run(["--help"], cwd=tmp_path).stdout)
    assert sections["commands"] == ["status", "verify", "run", "list", "version", "help"]
    assert sections["maintainer commands"] == ["compat", "fingerprints", "upstream-check"]
    assert sections["options"] == ["-h", "-V"]  # -V, --version


def test_every_command_has_a_description_and_every_option_a_help():
    parser = cli.build_parser("upstream-check")  # with its options (loaded only for it)
    sub = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    assert sorted(sub.choices) == sorted(name for _, commands in cli.COMMANDS for name, _ in commands)
    for name, command in sub.choices.items():
        assert command.description and len(command.description) > 40, name
        for action in command._actions:
            assert action.help, (name, action.option_strings or action.dest)


@pytest.mark.parametrize("command", ["verify", "fingerprints", "upstream-check", "compat", "run", "list"])
def test_command_help_describes_it(tmp_path, command):
    """``kvpatch COMMAND --help`` and ``kvpatch help COMMAND``: a description paragraph between usage and options."""
    proc = _run([command, "--help"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    blocks = proc.stdout.split("\n\n")
    assert blocks[0].startswith(f"usage: kvpatch {command}") and not blocks[1].startswith(("options:", "positional"))
    assert len(blocks[1]) > 40, proc.stdout
    assert _run(["help", command], cwd=tmp_path).stdout == proc.stdout


def test_compat_options_have_help(tmp_path):
    sections = _help_sections(_run(["compat", "--help"], cwd=tmp_path).stdout)
    assert sections["options"] == ["-h", "--write", "--check", "--path"]
    text = _run(["compat", "--help"], cwd=tmp_path).stdout
    assert "  --write " in text and "write the table" in text and "default: COMPAT.md" in text


def test_version(tmp_path):
    import kvpatch

    option = _run(["--version"], cwd=tmp_path)
    command = _run(["version"], cwd=tmp_path)
    short = _run(["-V"], cwd=tmp_path)  # as pip, ruff and uv accept it
    assert option.returncode == command.returncode == short.returncode == 0
    assert option.stdout == command.stdout == short.stdout and len(option.stdout.splitlines()) == 1
    assert option.stdout.startswith(f"kvpatch {kvpatch.__version__} from "), option.stdout
    assert f"(Python {sys.version_info.major}.{sys.version_info.minor}." in option.stdout


def test_list_names_every_patch_one_line_each(tmp_path):
    from kvpatch import registry

    ids = sorted(p.id for p in registry.load().patches)
    proc = _run(["list"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sorted(line.split()[0] for line in lines[:-1]) == ids
    assert lines[-1].startswith(f"{len(ids)} patches")
    as_json = json.loads(_run(["list", "--json"], cwd=tmp_path).stdout)
    assert sorted(p["id"] for p in as_json["patches"]) == ids and as_json["broken"] == {}


# -- run ------------------------------------------------------------------------------------------------------


def test_run_c_is_python_c(tmp_path):
    code = "import sys, kvpatch; print(sys.argv, __name__, kvpatch.get_engine() is not None)"
    proc = _run(["run", "-c", code, "a", "--b"], cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.strip() == "['-c', 'a', '--b'] __main__ True"
    assert _run(["run", "-c", "raise SystemExit(3)"], cwd=tmp_path).returncode == 3  # the program's own status


def test_run_module_and_script_from_the_working_directory(tmp_path):
    (tmp_path / "kvpatch_demo_prog.py").write_text("import sys; print(__name__, sys.argv[1:])\n")
    module = _run(["run", "-m", "kvpatch_demo_prog", "x"], cwd=tmp_path)
    assert module.returncode == 0 and module.stdout.strip() == "__main__ ['x']", module.stderr
    script = _run(["run", "kvpatch_demo_prog.py", "--y"], cwd=tmp_path)
    assert script.returncode == 0 and script.stdout.strip() == "__main__ ['--y']", script.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nonexist.py"], "can't open file 'nonexist.py'"),
        ([], "say what to run"),
        (["-c"], "-c needs the code to run"),
        (["-m"], "-m needs a module name"),
        (["--bogus"], "unknown option '--bogus'"),
        (["-m", "kvpatch_no_such_mod"], "no module named 'kvpatch_no_such_mod'"),
        (["-m", "kvpatch_no_such_pkg.sub"], "no module named 'kvpatch_no_such_pkg.sub'"),
    ],
)
def test_run_without_a_program_is_a_usage_error(tmp_path, args, message):
    proc = _run(["run", *args], cwd=tmp_path)
    assert proc.returncode == cli.EXIT_USAGE, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and message in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[0].startswith("usage: kvpatch run") and len(proc.stderr.splitlines()) == 2


def test_run_help_describes_it(tmp_path):
    proc = _run(["run", "--help"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for text in ("-c CODE", "-m MODULE", "SCRIPT", "the way `python` runs it", "exit status: the program's own"):
        assert text in proc.stdout, (text, proc.stdout)
    # after the program, --help is the program's
    child = _run(["run", "-c", "import sys; print(sys.argv)", "--help"], cwd=tmp_path)
    assert child.stdout.strip() == "['-c', '--help']"


# -- words ---------------------------------------------------------------------------------------------------


def test_status_names_the_check_exit_only_when_asked(tmp_path):
    plain = _run(["status"], cwd=tmp_path)
    assert plain.returncode == 0 and "--check exits" not in plain.stdout, plain.stdout
    assert "check: clean, nothing needs attention" in plain.stdout
    check = _run(["status", "--check"], cwd=tmp_path)
    assert check.returncode == 0 and "check: clean (exit 0)" in check.stdout, check.stdout


def test_verify_summary_says_what_it_verified(tmp_path):
    """``kvpatch verify`` measures only what the installed release leaves open; its summary says so (it said
    "0 verdict(s) for this environment" right after `status --verify` had measured 23)."""
    proc = _run(["verify"], cwd=tmp_path, env={"KVPATCH_VERDICTS": str(tmp_path / "v")})
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.splitlines()[-1]
    every = {"KVPATCH_VERDICTS": str(tmp_path / "v"), "KVPATCH_ENABLE": "*"}  # verify measures opt-in patches too
    status = json.loads(_run(["status", "--json"], cwd=tmp_path, env=every).stdout)
    left = sum(p["action"] == "verify" for p in status["patches"])  # 0 for an index install of a known release
    said = re.match(r"kvpatch verify: verified (\d+) patch\(es\) whose outcome depends on a reproduction here", last)
    # at most those the release leaves open (fewer where a fix would change nothing here, e.g. a CUDA-only one)
    assert said and int(said[1]) <= left and (left or said[1] == "0"), (left, last)
    assert "decided by the installed release need none" in last and last.endswith("0 need attention (exit 0)")


@pytest.mark.parametrize("columns", ["60", "100"])
def test_status_verbose_wraps_to_the_terminal_and_json_does_not(tmp_path, columns):
    """Not a terminal: ``$COLUMNS`` or 80. A word longer than the line (a URL) is kept whole, on its own."""
    site = _fake_mlx_lm(tmp_path / "site", b"Metadata-Version: 2.1\nName: mlx-lm\nVersion: 0.32.2\n")
    env = {"COLUMNS": columns, "PYTHONPATH": str(site)}
    text = _run(["status", "-v", "--no-settle"], cwd=tmp_path, env=env).stdout
    assert "reference: " in text  # mlx-lm's patches are listed
    long = [line for line in text.splitlines() if len(line) > int(columns) and len(line.split()) > 2]
    assert not long, long
    default = _run(["status", "-v", "--no-settle"], cwd=tmp_path, env={"PYTHONPATH": str(site)}).stdout
    assert max(len(line) for line in default.splitlines() if len(line.split()) > 2) <= 80
    narrow = json.loads(_run(["status", "--json", "--no-settle"], cwd=tmp_path, env=env).stdout)
    env["COLUMNS"] = "400"
    wide = json.loads(_run(["status", "--json", "--no-settle"], cwd=tmp_path, env=env).stdout)
    assert [p["reason"] for p in narrow["patches"]] == [p["reason"] for p in wide["patches"]]


def test_internal_error_exits_70_with_the_traceback(monkeypatch, capsys):
    def boom(*args, **kwargs):
        raise RuntimeError("simulated bug in kvpatch")

    monkeypatch.setattr(cli, "build_report", boom)
    assert cli.main(["status", "--check"]) == cli.EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "Traceback" in err and "simulated bug in kvpatch" in err and "internal error (exit 70)" in err


def test_a_command_exiting_with_a_message_is_a_usage_error(monkeypatch, capsys):
    def leave(*args, **kwargs):
        raise SystemExit("kvpatch: simulated message")

    monkeypatch.setattr(cli, "build_report", leave)
    assert cli.main(["status"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == "kvpatch: simulated message\n"


def test_a_kvpatch_that_cannot_be_imported_exits_70(tmp_path):
    broken = tmp_path / "site"
    (broken / "kvpatch").mkdir(parents=True)
    (broken / "kvpatch" / "__init__.py").write_text("raise ImportError('simulated broken install')\n")
    proc = _run(["status", "--check"], cwd=tmp_path, env={"PYTHONPATH": str(broken)})
    assert proc.returncode == cli.EXIT_INTERNAL, (proc.returncode, proc.stdout, proc.stderr)
    assert "cannot be imported" in proc.stderr and "simulated broken install" in proc.stderr


# -- output that cannot be written ----------------------------------------------------------------------------

OUTPUT_COMMANDS = [
    ["status"],
    ["status", "--json"],
    ["status", "-v"],
    ["--help"],
    ["status", "--help"],
    ["list"],
    ["version"],
    [],
    ["run", "--help"],
]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
@pytest.mark.parametrize("args", OUTPUT_COMMANDS, ids=" ".join)
def test_full_disk_is_an_io_error(tmp_path, args):
    """``> /dev/full``: exit 74 (EX_IOERR) and one line on stderr, not a "bug in kvpatch" traceback (70)."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [str(SCRIPT), *args], cwd=tmp_path, env=child_env(), stdout=full, stderr=subprocess.PIPE, text=True
        )
    assert proc.returncode == cli.EXIT_IOERR, (proc.returncode, proc.stderr)
    assert proc.stderr.splitlines() == ["kvpatch: cannot write the output: No space left on device (exit 74)"], (
        proc.stderr
    )


@pytest.mark.parametrize("args", [*OUTPUT_COMMANDS[:4], ["verify"]], ids=" ".join)
def test_closed_stdout_is_an_io_error(tmp_path, args):
    """``kvpatch status >&-``: Python starts with ``sys.stdout`` None; exit 74, one line."""
    proc = subprocess.run(
        ["bash", "-c", f"'{SCRIPT}' {' '.join(args)} >&-"],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == cli.EXIT_IOERR, (proc.returncode, proc.stderr)
    assert proc.stderr.splitlines() == ["kvpatch: cannot write the output: standard output is closed (exit 74)"]


def test_io_error_is_in_the_exit_status_table(tmp_path):
    assert cli.EXIT_IOERR == 74 and 74 in dict(cli.EXIT_CODES)
    assert "  74   the output could not be written" in _run(["status", "--help"], cwd=tmp_path).stdout


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


#: The one function of the runtime allowed to import kvpatch.maint: the maintainer commands' dispatch.
_MAINTAINER_DISPATCH = {("cli.py", "build_parser")}


def _forbidden_imports(source: str, module: str) -> list[str]:
    """Every import of ``kvpatch.maint`` or ``kvpatch.testing`` in ``source`` (the module ``module``), at the top
    or inside a function, as ``"function: imported name"`` (``<module>`` at the top); relative imports resolved."""
    import ast

    package = module.split(".")[:-1]
    found = []

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            names = [a.name for a in child.names] if isinstance(child, ast.Import) else []
            if isinstance(child, ast.ImportFrom):
                parts = package[: len(package) - child.level + 1] if child.level else []
                base = ".".join([*parts, *([child.module] if child.module else [])])
                names = [base, *(f"{base}.{a.name}" for a in child.names)]
            for name in names:
                if name.split(".")[:2] in (["kvpatch", "maint"], ["kvpatch", "testing"]):
                    found.append(f"{where}: {name}")
            visit(child, inner)

    visit(ast.parse(source), "<module>")
    return sorted(set(found))


def _runtime_modules():
    """Every runtime module: ``kvpatch/`` without ``kvpatch/maint/`` and ``kvpatch/testing.py``."""
    root = REPO / "kvpatch"
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] != "maint" and rel != Path("testing.py"):
            yield path, ".".join(("kvpatch", *rel.with_suffix("").parts))


def test_the_runtime_imports_no_maintainer_or_test_code():
    """No runtime module (kvpatch.patches included) imports kvpatch.maint or kvpatch.testing, at the top or in a
    function, except the maintainer commands' dispatch in cli.py."""
    modules = list(_runtime_modules())
    assert any(name.startswith("kvpatch.patches.mlx_lm.") for _, name in modules) and len(modules) > 40
    found = []
    for path, name in modules:
        for hit in _forbidden_imports(path.read_text(encoding="utf-8"), name):
            if (path.name, hit.split(":")[0]) not in _MAINTAINER_DISPATCH:
                found.append(f"{path.relative_to(REPO)} {hit}")
    assert not found, found


def test_the_import_scan_finds_each_form_of_import():
    """The scan above cannot pass by missing an import: each form is found where it is."""
    source = (
        "from .maint import envs\n"
        "import kvpatch.testing\n"
        "from kvpatch import maint\n"
        "def f():\n"
        "    from ...testing import x\n"
        "    from .maintenance import y\n"
    )
    assert _forbidden_imports(source, "kvpatch.status") == [
        "<module>: kvpatch.maint",
        "<module>: kvpatch.maint.envs",
        "<module>: kvpatch.testing",
    ]
    assert _forbidden_imports(source, "kvpatch.patches.mlx_lm.unit") == [
        "<module>: kvpatch.maint",
        "<module>: kvpatch.testing",
        "f: kvpatch.testing",
        "f: kvpatch.testing.x",
    ]


def test_enforce_adds_review_by_facts_without_error(tmp_path):
    """KVPATCH_ENFORCE=1 (kvpatch's own CI) adds the review-by facts, computed by the runtime's records."""
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
    verdicts._loaded = None  # read the file afresh
    assert settle.environment_key(engine) != before
