"""pytest plugin for projects that depend on kvpatch (the ``pytest11`` entry point ``kvpatch``); off unless enabled.

``--kvpatch-require-applied`` (ini ``kvpatch_require_applied = true``) fails the session when a patch that applies
to the installed upstream is not applied at its end. ``--kvpatch-verify`` (ini ``kvpatch_verify = true``) first runs
``python -m kvpatch verify --missing`` in a child; a verdict that needs attention fails the session. The fixture
``kvpatch_status`` returns ``kvpatch.records()``. kvpatch is imported only when an option is on (at configure time,
before test modules import upstream) or a test asks for the fixture."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

_REQUIRE = "kvpatch_require_applied"
_VERIFY = "kvpatch_verify"
#: What the session found, kept on the config (not ``config.stash``: any pytest a user has loads this)
_VERIFIED = "_kvpatch_verify_result"
_FOUND = "_kvpatch_require_applied_problems"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvpatch")
    for name, text in (
        (_REQUIRE, "fail the session when a kvpatch patch that applies to the installed upstream is not applied"),
        (_VERIFY, "settle kvpatch's verdicts for this environment (python -m kvpatch verify) before the session"),
    ):
        option = "--" + name.replace("_", "-")
        group.addoption(option, action="store_true", default=None, dest=name, help=text)
        parser.addini(name, type="bool", default=False, help=f"same as {option}")


def _on(config: pytest.Config, name: str) -> bool:
    option = config.getoption(name, default=None)
    return bool(config.getini(name) if option is None else option)


def _run_verify() -> tuple[int, str]:
    """``python -m kvpatch verify --missing`` in a child (``-P``, in ``/``, like every child kvpatch starts; this
    module must not import kvpatch, which would activate it): (exit status, its last lines)."""
    import subprocess
    import sys

    safe = ["-P"] if sys.version_info >= (3, 11) else []
    command = [sys.executable, *safe, "-m", "kvpatch", "verify", "--missing"]
    try:
        proc = subprocess.run(command, cwd="/", capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.SubprocessError) as exc:
        return 1, f"kvpatch verify could not run: {exc}"
    return proc.returncode, "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-40:])


def pytest_configure(config: pytest.Config) -> None:
    if _on(config, _VERIFY):
        setattr(config, _VERIFIED, _run_verify())  # before anything imports upstream (or kvpatch) here
    if _on(config, _REQUIRE):
        import kvpatch  # noqa: F401  (importing activates it before the tests import upstream)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    failed = getattr(config, _VERIFIED, (0, ""))[0] != 0
    if _on(config, _REQUIRE):
        from kvpatch import assertions, get_engine

        found = assertions.problems(get_engine())
        setattr(config, _FOUND, found)
        failed = failed or bool(found[1])
    if failed and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    code, text = getattr(config, _VERIFIED, (None, ""))
    if code:
        terminalreporter.section("kvpatch verify: needs attention", sep="=", red=True, bold=True)
        terminalreporter.line(textwrap.indent(text, "  "), red=True)
    elif code == 0:
        terminalreporter.line(text.splitlines()[-1] if text else "kvpatch verify: nothing to settle")
    applicable, found = getattr(config, _FOUND, (None, None))
    if found:
        terminalreporter.section("kvpatch: applicable patches not applied", sep="=", red=True, bold=True)
        terminalreporter.line("\n".join(f"  - {problem}" for problem in found), red=True)
        terminalreporter.line(f"--kvpatch-require-applied: failing the session ({len(found)} problem(s))", red=True)
    elif applicable is not None:
        applied = ", ".join(st.patch.id for st in applicable if st.state.value == "applied") or "none"
        terminalreporter.line(f"kvpatch: {len(applicable)} applicable patch(es), every one applied ({applied})")


@pytest.fixture
def kvpatch_status() -> list[Any]:
    """The status of every kvpatch patch in this process (``kvpatch.records()``)."""
    import kvpatch

    return kvpatch.records()
