"""Where the docs state behaviour, the code does it: the defaults in docs/configuration.md (and any "`VAR` defaults
to `X`" in the docs) are the defaults the code and scripts read; docs/status.md's exit-code table is the CLI's; the
output docs/servers.md names for `checked_through` has it; CONTRIBUTING.md's names, paths and record fields exist;
scripts/test.sh's header names the tiers a run has."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import os
import re
import stat
import subprocess
import sys

from support import REPO, child_env

from kvpatch import cli
from kvpatch.record import Patch

DOCS = REPO / "docs"
CONTRIBUTING = (REPO / "CONTRIBUTING.md").read_text(encoding="utf-8")
#: A default as the configuration table words it: "(default 2)", "(default: `all`, or `newest` with ...)",
#: "default `~/.cache/kvpatch`", and "`1` (default)".
DEFAULT = re.compile(r"default:? `?([\w.~/-]+)`?(?:, or `([\w.~/-]+)`)?")
DEFAULT_BEFORE = re.compile(r"`([^`]+)` \(default\)")
#: "`<variable>` defaults to `<value>`" in prose.
DEFAULTS_TO = re.compile(r"`(KVPATCH\w*)` defaults to `([^`]+)`")


def _code_defaults() -> dict[str, set[str]]:
    """Variable -> the non-empty literal defaults the code gives it: ``os.environ.get("VAR", ...)`` in Python (every
    string literal of the default expression) and ``${VAR:-...}`` in the shell scripts."""
    found: dict[str, set[str]] = {}
    for path in [p for folder in ("kvpatch", "scripts", "tests") for p in (REPO / folder).rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"):
                continue
            owner = node.func.value
            environ = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if not (environ == "environ" and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)):
                continue
            name = str(node.args[0].value)
            literals = {
                n.value for n in ast.walk(node.args[1]) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            }
            if name.startswith("KVPATCH") and literals - {""}:
                found.setdefault(name, set()).update(literals - {""})
    for path in [*(REPO / "scripts").glob("*.sh"), REPO / ".ci" / "run"]:
        for name, value in re.findall(r"\$\{(KVPATCH\w*):-([^}]*)\}", path.read_text(encoding="utf-8")):
            found.setdefault(name, set()).add(value)
    return found


def _configuration_rows() -> dict[str, tuple[str, str]]:
    """docs/configuration.md's table: variable -> (values cell, effect cell)."""
    rows = {}
    for line in (DOCS / "configuration.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`KVPATCH"):
            for name in re.findall(r"`(KVPATCH\w*)`", cells[0]):
                rows[name] = (cells[1], cells[2])
    return rows


def test_configuration_defaults_are_the_code_s():
    """Every variable the code reads with a literal default says that default in the table, and nothing else;
    variables the table marks as set by kvpatch or the tests are the code's own sentinels."""
    rows, wrong = _configuration_rows(), []
    for name, code in sorted(_code_defaults().items()):
        values, effect = rows[name]
        if values.startswith("set by"):
            continue
        documented = {d for m in DEFAULT.findall(values + " " + effect) for d in m if d}
        documented |= set(DEFAULT_BEFORE.findall(values))
        if documented != code:
            wrong.append(f"{name}: docs/configuration.md says {sorted(documented)}, the code {sorted(code)}")
    assert not wrong, "\n".join(wrong)


def test_defaults_stated_in_prose_are_the_code_s():
    code, wrong = _code_defaults(), []
    for path in [*sorted(DOCS.glob("*.md")), REPO / "CONTRIBUTING.md", REPO / "README.md"]:
        for name, value in DEFAULTS_TO.findall(" ".join(path.read_text(encoding="utf-8").split())):
            if value not in code.get(name, set()):
                wrong.append(f"{path.relative_to(REPO)}: {name} defaults to {value!r}; the code: {code.get(name)}")
    assert not wrong, "\n".join(wrong)


def test_the_exit_code_table_is_the_cli_s():
    text = (DOCS / "status.md").read_text(encoding="utf-8")
    table = text[text.index("## Exit status") :]
    table = table[: table.index("\n\n", table.index("| code |"))]
    documented = [int(code) for code in re.findall(r"^\| (\d+) \|", table, re.M)]
    assert documented == [code for code, _ in cli.EXIT_CODES]


def test_the_output_servers_md_names_for_checked_through_has_it(tmp_path):
    text = " ".join((DOCS / "servers.md").read_text(encoding="utf-8").split())
    assert "`python -m kvpatch status --json` gives each patch's `checked_through`" in text
    proc = subprocess.run(
        [sys.executable, "-m", "kvpatch", "status", "--json", "--no-settle"],
        cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    patches = json.loads(proc.stdout)["patches"]
    assert patches and all("checked_through" in p for p in patches)
    assert any(p["checked_through"] for p in patches)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return False
        return True
    return False


def test_contributing_names_only_what_exists():
    """Dotted names (``kvpatch.registry.module_for``) import, and repository paths exist."""
    names = set(re.findall(r"`(kvpatch(?:\.\w+)+)", CONTRIBUTING))
    assert "kvpatch.registry.module_for" in names
    assert not [n for n in sorted(names) if not _resolves(n)]
    (example,) = re.findall(r"python -m kvpatch\.maint\.new (\S+)", CONTRIBUTING)  # what the example would write
    paths = set(re.findall(r"`((?:kvpatch|tests|scripts|docs)/[\w./-]+)`", CONTRIBUTING))
    paths = {p for p in paths if example.replace("-", "_") not in p}
    assert not [p for p in sorted(paths) if not (REPO / p).exists()]


def test_contributing_explains_every_record_field():
    """Each field a unit sets in ``Patch(...)`` has its row in "The record"."""
    section = CONTRIBUTING[CONTRIBUTING.index("### The record") :]
    section = section[: section.index("\n### ", 5)]
    explained = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    internal = {
        "targets",
        "builders",
        "reproduction",
        "restore_hooks",
        "module",
    }  # the decorators and registry fill them
    assert explained == {f.name for f in dataclasses.fields(Patch)} - internal


def test_the_test_script_header_names_what_a_quick_run_runs(tmp_path):
    """``bash scripts/test.sh --quick`` without a venv sets one up and says it runs the quick tiers, not every
    bucket (a stand-in python records the venv, pip and pytest steps instead of doing them)."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python";'
        ' printf "#!/bin/sh\\necho pytest \\"\\$@\\"\\n" > "$3/bin/pytest"; chmod +x "$3/bin/pytest"; fi\n'
        'if [ "$1" = "--version" ]; then echo "Python 3"; fi\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {k: v for k, v in os.environ.items() if k != "KVPATCH_MATRIX"}
    env |= {"PYTHON": str(fake), "KVPATCH_VENV": str(tmp_path / "venv")}
    proc = subprocess.run(
        ["bash", "scripts/test.sh", "--quick", "-x"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    header = next(line for line in proc.stdout.splitlines() if "[4/4]" in line)
    assert "tiers: unit, patch (matrix buckets: newest)" in header and "buckets: all" not in header
    assert proc.stdout.rstrip().endswith("pytest -x")
    proc = subprocess.run(["bash", "scripts/test.sh", "--quick"], cwd=REPO, env=env, capture_output=True, text=True)
    assert "[quick]" in proc.stdout and "tiers: unit, patch (matrix buckets: newest)" in proc.stdout


def test_readme_links_are_absolute_and_name_files_of_this_repository():
    """PyPI shows the README without the repository: a relative link breaks there. Links into the repository
    (``[project.urls] Source`` + ``/blob/main/``) name files that exist."""
    (source,) = re.findall(r'^Source = "([^"]+)"$', (REPO / "pyproject.toml").read_text(encoding="utf-8"), re.M)
    base = source.rstrip("/") + "/blob/main/"
    links = re.findall(r"\]\(([^)\s]+)\)", (REPO / "README.md").read_text(encoding="utf-8"))
    assert not [t for t in links if not re.match(r"https?://", t) and not t.startswith("#")]
    mine = [t.removeprefix(base).split("#")[0] for t in links if t.startswith(base)]
    assert mine and not [p for p in mine if not (REPO / p).exists()]
    assert not [t for t in links if t.startswith(source) and not t.startswith(base)]
