"""The documentation: the docs site builds strictly, and the README stays a short page for users.

``mkdocs build --strict`` (mkdocs.yml) fails on a broken link, a missing page, a missing included file
(the status schema, COMPAT.md) or an API entry that does not resolve; the second build test shows that a
broken link does fail it, so the first cannot pass by accident.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO

#: What the build needs (the `test` extra installs them).
_BUILD_MODULES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python", "pymdownx")


def _missing(modules: tuple[str, ...]) -> list[str]:
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # the parent package is absent
            found = False
        if not found:
            missing.append(name)
    return missing


_MISSING = _missing(_BUILD_MODULES)
needs_mkdocs = pytest.mark.skipif(
    bool(_MISSING), reason=f"docs build tools not installed ({', '.join(_MISSING)}): pip install '.[test]'"
)

README_MAX_LINES = 150
ISO_DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
OUTSIDE = re.compile(r"\.\./shared|\$OUT\b")


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        cwd=config.parent,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )


@needs_mkdocs
def test_docs_build_strictly(tmp_path):
    proc = _build(REPO / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("activate", "deactivate", "records", "require_applied", "kvpatch_status", "kvpatch.status/1"):
        assert name in api, f"the API reference lacks {name}"


@needs_mkdocs
def test_a_broken_link_fails_the_build(tmp_path):
    """The same configuration on a copy of the docs with one link to a page that does not exist."""
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    for included in ("kvpatch", "COMPAT.md"):  # what the pages include or document
        (tmp_path / included).symlink_to(REPO / included)
    with open(tmp_path / "docs" / "index.md", "a", encoding="utf-8") as fh:
        fh.write("\nSee [the missing page](no-such-page.md).\n")
    proc = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "no-such-page.md" in proc.stdout + proc.stderr


def _readme() -> str:
    return (REPO / "README.md").read_text(encoding="utf-8")


def test_readme_is_short():
    lines = _readme().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {README_MAX_LINES})"


@pytest.mark.parametrize("path", ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))])
def test_no_history_or_outside_references(path):
    """History (dates, commits) belongs to CHANGELOG.md; nothing points outside the repository."""
    text = (REPO / path).read_text(encoding="utf-8")
    assert not ISO_DATE.findall(text), f"{path}: dates {ISO_DATE.findall(text)} (history goes to CHANGELOG.md)"
    assert not OUTSIDE.findall(text), f"{path}: references outside the repository: {OUTSIDE.findall(text)}"
    if path == "README.md":
        assert not COMMIT_HASH.findall(text), f"README.md: commit hashes {COMMIT_HASH.findall(text)}"


def test_readme_keeps_the_two_commands():
    """The install-and-audit command and the test command that work on a fresh machine with only Python;
    ``.ci/run`` runs exactly the second."""
    readme = _readme()
    install = (
        'python3 -m venv /tmp/kvpatch-env && /tmp/kvpatch-env/bin/pip install ".[lm]" && '
        "/tmp/kvpatch-env/bin/kvpatch status --verify"
    )
    assert install in readme
    assert "\nbash scripts/test.sh\n" in readme
    assert "\nbash scripts/test.sh\n" in (REPO / ".ci" / "run").read_text(encoding="utf-8")


def test_configuration_lists_every_environment_variable():
    """docs/configuration.md's one table names every ``KVPATCH*`` variable the code, scripts and tests read."""
    documented = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    name = re.compile(r"\bKVPATCH(?:_[A-Z0-9]+)*\b")
    sources = [p for folder in ("kvpatch", "scripts", "tests") for p in (REPO / folder).rglob("*.py")]
    sources += [*(REPO / "scripts").glob("*.sh"), REPO / ".ci" / "run"]
    found = {m for path in sources for m in name.findall(path.read_text(encoding="utf-8"))}
    missing = sorted(v for v in found if f"`{v}`" not in documented)
    assert not missing, f"add them to docs/configuration.md: {missing}"
