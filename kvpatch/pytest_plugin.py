"""pytest plugin for projects that depend on kvpatch (registered as the ``pytest11`` entry point ``kvpatch``).

Off unless enabled: ``--kvpatch-require-applied`` (or ``kvpatch_require_applied = true`` in the
pytest ini) fails the test session when any patch that applies to the installed upstream is not
applied at the end of the session: failed, drifted, disabled (``KVPATCH=off`` / ``KVPATCH_DISABLE``),
or pending although the session imported its target modules (see :mod:`kvpatch.assertions`).

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


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvpatch")
    group.addoption(
        _OPTION,
        action="store_true",
        default=None,
        help="fail the session when a kvpatch patch that applies to the installed mlx-lm / mlx-vlm is not applied",
    )
    parser.addini(_INI, type="bool", default=False, help="same as --kvpatch-require-applied")


def _enabled(config: pytest.Config) -> bool:
    option = config.getoption(_OPTION, default=None)
    if option is not None:
        return bool(option)
    return bool(config.getini(_INI))


def pytest_configure(config: pytest.Config) -> None:
    if _enabled(config):
        import kvpatch  # noqa: F401  (importing activates it before the tests import upstream)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if not _enabled(config):
        return
    import kvpatch
    from kvpatch.assertions import problems

    applicable, found = problems(kvpatch.get_engine())
    setattr(config, _KEY, (applicable, found))
    if found and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
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
