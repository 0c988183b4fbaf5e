"""pytest plugin for projects that depend on kvpatch (registered as the ``pytest11`` entry point ``kvpatch``).

Off unless enabled: ``--kvpatch-require-applied`` (or ``kvpatch_require_applied = true`` in the
pytest ini) fails the test session when any patch that applies to the installed upstream is not
applied at the end of the session: failed, drifted, disabled (``KVPATCH=off`` / ``KVPATCH_DISABLE``),
or pending although the session imported its target modules (see :mod:`kvpatch.assertions`).

``--kvpatch-verify`` (or ``kvpatch_verify = true``) runs ``python -m kvpatch verify --missing`` in a
child process before the session, so that every patch the reproduction decides (a release newer than
kvpatch has checked, an editable or git install of upstream) has this environment's verdict before the
tests import upstream; a verification that needs attention (inconclusive, drifted, could not run) fails
the session. Nothing of it runs in the test process itself.

The fixture ``kvpatch_status`` returns the status records (``kvpatch.records()``).

This module imports nothing of kvpatch's engine at top level: kvpatch is imported inside the hooks
only when the option is on (it is then imported at configure time, before test modules import
upstream) and inside the fixture when a test asks for it.
"""

from __future__ import annotations

from typing import Any

import pytest

_OPTION = "--kvpatch-require-applied"
_INI = "kvpatch_require_applied"
_KEY = "_kvpatch_require_applied_problems"
_VERIFY_OPTION = "--kvpatch-verify"
_VERIFY_INI = "kvpatch_verify"
_VERIFY_KEY = "_kvpatch_verify_result"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvpatch")
    group.addoption(
        _OPTION,
        action="store_true",
        default=None,
        help="fail the session when a kvpatch patch that applies to the installed mlx-lm / mlx-vlm is not applied",
    )
    parser.addini(_INI, type="bool", default=False, help="same as --kvpatch-require-applied")
    group.addoption(
        _VERIFY_OPTION,
        action="store_true",
        default=None,
        help="settle kvpatch's verdicts for this environment (python -m kvpatch verify) before the session",
    )
    parser.addini(_VERIFY_INI, type="bool", default=False, help="same as --kvpatch-verify")


def _enabled(config: pytest.Config) -> bool:
    option = config.getoption(_OPTION, default=None)
    if option is not None:
        return bool(option)
    return bool(config.getini(_INI))


def _verify_enabled(config: pytest.Config) -> bool:
    option = config.getoption(_VERIFY_OPTION, default=None)
    if option is not None:
        return bool(option)
    return bool(config.getini(_VERIFY_INI))


def _run_verify() -> tuple[int, str]:
    """``python -m kvpatch verify --missing`` in a child process: (exit status, its last lines).

    As every child kvpatch starts (``kvpatch.measurer``' background verifier too), it runs no code from a directory
    kvpatch did not choose: ``-P`` keeps the test session's working directory off its ``sys.path``, and it runs in
    ``/``. (This module must not import kvpatch, which would activate it, so it cannot share that code.)
    """
    import subprocess
    import sys

    safe = ["-P"] if sys.version_info >= (3, 11) else []
    try:
        proc = subprocess.run(
            [sys.executable, *safe, "-m", "kvpatch", "verify", "--missing"],
            cwd="/",
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return 1, f"kvpatch verify could not run: {exc}"
    text = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-40:])
    return proc.returncode, text


def pytest_configure(config: pytest.Config) -> None:
    if _verify_enabled(config):
        setattr(config, _VERIFY_KEY, _run_verify())  # before anything imports upstream (or kvpatch) here
    if _enabled(config):
        import kvpatch  # noqa: F401  (importing activates it before the tests import upstream)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    verified = getattr(config, _VERIFY_KEY, None)
    if verified is not None and verified[0] != 0 and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if not _enabled(config):
        return
    import kvpatch
    from kvpatch.assertions import problems

    applicable, found = problems(kvpatch.get_engine())
    setattr(config, _KEY, (applicable, found))
    if found and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    verified = getattr(config, _VERIFY_KEY, None)
    if verified is not None:
        code, text = verified
        if code != 0:
            terminalreporter.section("kvpatch verify: needs attention", sep="=", red=True, bold=True)
            for line in text.splitlines():
                terminalreporter.line(f"  {line}", red=True)
        else:
            terminalreporter.line(text.splitlines()[-1] if text else "kvpatch verify: nothing to settle")
    result = getattr(config, _KEY, None)
    if result is None:
        return
    applicable, found = result
    if found:
        terminalreporter.section("kvpatch: applicable patches not applied", sep="=", red=True, bold=True)
        for problem in found:
            terminalreporter.line(f"  - {problem}", red=True)
        terminalreporter.line(f"{_OPTION}: failing the session ({len(found)} problem(s))", red=True)
    else:
        applied = ", ".join(st.patch.id for st in applicable if st.state.value == "applied") or "none"
        terminalreporter.line(f"kvpatch: {len(applicable)} applicable patch(es), every one applied ({applied})")


@pytest.fixture
def kvpatch_status() -> list[Any]:
    """The status of every kvpatch patch in this process (``kvpatch.records()``)."""
    import kvpatch

    return kvpatch.records()
