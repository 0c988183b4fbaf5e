"""The downstream pytest plugin (``kvpatch.pytest_plugin``) and ``kvpatch.assertions``.

The session tests run pytest in a fresh process (``pytester.runpytest_subprocess``). The ones that need
a patch to apply run on real layered releases (the matrix bucket ``lm-0.23.2``: mlx-lm 0.23.2, where
``mask-fill`` and ``qsdpa-gqa-batch-mask`` apply), built or found in the layer cache.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys

import pytest
from matrix import BY_NAME
from support import skip_if_no_index, synthetic_patch

from kvpatch.assertions import NotApplied, problems
from kvpatch.config import Config
from kvpatch.detect import Upstream
from kvpatch.engine import Engine, State
from kvpatch.maint.envs import CACHE_VAR, cache_dir
from kvpatch.record import Patch

pytest_plugins = ["pytester"]

BUCKET = BY_NAME["lm-0.23.2"]
#: The layer cache, resolved before pytester points HOME at a temporary directory (which would rebuild the bucket's
#: layers, downloads included, for every test).
LAYER_CACHE = str(cache_dir())
USES_UPSTREAM = """
def test_uses_upstream():
    import mlx_lm.models.base  # the module mask-fill and qsdpa-gqa-batch-mask patch
"""
NO_UPSTREAM = """
import sys

def test_plain():
    assert 1 + 1 == 2
    print("ENGINE-MODULES", sorted(m for m in sys.modules if m.startswith(("kvpatch.assertions", "wrapt"))))
"""


def _plugin_args() -> list[str]:
    """``-p kvpatch.pytest_plugin`` unless the installed entry point already loads it."""
    registered = any(
        ep.value in ("kvpatch.pytest_plugin", "kvpatch_pytest")
        for ep in importlib.metadata.entry_points(group="pytest11")
    )
    if registered and not os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return []
    return ["-p", "kvpatch.pytest_plugin"]


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("KVPATCH") and name not in ("KVPATCH_CACHE", "KVPATCH_VERDICTS", "KVPATCH_VERIFY"):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def upstream_env(clean_env):
    """PYTHONPATH with the lm-0.23.2 bucket's layers first (built once, cached)."""
    from kvpatch.maint.envs import EnvBuildError, build

    clean_env.setenv(CACHE_VAR, LAYER_CACHE)
    try:
        layers = build(BUCKET)
    except EnvBuildError as exc:  # pragma: no cover - no index reachable
        skip_if_no_index(str(exc), f"bucket {BUCKET.name}")
        raise
    kvpatch_root = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["kvpatch"].__file__)))
    paths = (
        [str(p) for p in layers] + [kvpatch_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    clean_env.setenv("PYTHONPATH", os.pathsep.join(paths))
    return clean_env


# -- sessions without upstream ------------------------------------------------------------------------


def test_off_by_default_leaves_the_session_alone(pytester, clean_env):
    pytester.makepyfile(test_plain=NO_UPSTREAM)
    result = pytester.runpytest_subprocess(*_plugin_args(), "-s")
    result.assert_outcomes(passed=1)
    assert "kvpatch:" not in result.stdout.str()
    # the plugin's hooks never reached the engine: no assertion module, no import hooks
    assert "ENGINE-MODULES []" in result.stdout.str()


@pytest.mark.skipif(
    importlib.util.find_spec("mlx_lm") is not None or importlib.util.find_spec("mlx_vlm") is not None,
    reason="an upstream is installed in this environment",
)
def test_enabled_without_upstream_passes(pytester, clean_env):
    pytester.makepyfile(test_plain=NO_UPSTREAM)
    result = pytester.runpytest_subprocess(*_plugin_args(), "--kvpatch-require-applied")
    result.assert_outcomes(passed=1)
    assert result.ret == 0
    result.stdout.fnmatch_lines(["kvpatch: 0 applicable patch(es), every one applied (none)"])


def test_verify_option_settles_verdicts_in_a_child_before_the_session(pytester, clean_env, tmp_path):
    """``--kvpatch-verify`` runs ``python -m kvpatch verify --missing`` in a child process first; nothing of
    kvpatch loads in the test process for it."""
    clean_env.setenv("KVPATCH_VERDICTS", str(tmp_path / "verdicts"))
    pytester.makepyfile(test_plain=NO_UPSTREAM)
    result = pytester.runpytest_subprocess(*_plugin_args(), "-s", "--kvpatch-verify")
    result.assert_outcomes(passed=1)
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "kvpatch verify: verified * patch(es) whose outcome depends on a reproduction here*; 0 need attention (exit 0)"
        ]
    )
    assert "ENGINE-MODULES []" in result.stdout.str()


def test_fixture_returns_the_records(pytester, clean_env):
    pytester.makepyfile(
        test_fixture="""
def test_records(kvpatch_status):
    import kvpatch
    assert [s.patch.id for s in kvpatch_status] == [s.patch.id for s in kvpatch.records()]
    assert kvpatch_status and all(isinstance(s, kvpatch.PatchStatus) for s in kvpatch_status)
"""
    )
    result = pytester.runpytest_subprocess(*_plugin_args())
    result.assert_outcomes(passed=1)


# -- sessions on a real upstream release ---------------------------------------------------------------


@pytest.mark.slow
def test_required_and_applied_passes(pytester, upstream_env):
    pytester.makepyfile(test_up=USES_UPSTREAM)
    result = pytester.runpytest_subprocess(*_plugin_args(), "--kvpatch-require-applied")
    result.assert_outcomes(passed=1)
    assert result.ret == 0, result.stdout.str()
    result.stdout.re_match_lines([r"kvpatch: \d+ applicable patch\(es\), every one applied \(.*mask-fill.*\)"])


@pytest.mark.slow
def test_disabled_patch_fails_the_session(pytester, upstream_env):
    upstream_env.setenv("KVPATCH_DISABLE", "mask-fill")
    pytester.makepyfile(test_up=USES_UPSTREAM)
    result = pytester.runpytest_subprocess(*_plugin_args(), "--kvpatch-require-applied")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*kvpatch: applicable patches not applied*", "*mask-fill: NOT FIXED: disabled*"])


@pytest.mark.slow
def test_kvpatch_off_fails_the_session_via_ini(pytester, upstream_env):
    upstream_env.setenv("KVPATCH", "off")
    pytester.makeini("[pytest]\nkvpatch_require_applied = true\n")
    pytester.makepyfile(test_up=USES_UPSTREAM)
    result = pytester.runpytest_subprocess(*_plugin_args())
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*mask-fill: NOT FIXED: disabled: kvpatch is off*"])


@pytest.mark.slow
def test_option_off_ignores_a_disabled_patch(pytester, upstream_env):
    upstream_env.setenv("KVPATCH_DISABLE", "mask-fill")
    pytester.makepyfile(test_up=USES_UPSTREAM)
    result = pytester.runpytest_subprocess(*_plugin_args())
    result.assert_outcomes(passed=1)
    assert result.ret == 0


@pytest.mark.slow
def test_require_applied_at_server_start(upstream_env):
    import subprocess

    code = (
        "import kvpatch.assertions as a, kvpatch\n"
        "try:\n"
        "    ok = a.require_applied()\n"
        "    print('OK', sorted(s.patch.id for s in ok))\n"
        "except a.NotApplied as exc:\n"
        "    print('RAISED', [p.patch_id for p in exc.problems])\n"
    )

    def run(extra):
        env = {**os.environ, **extra}
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300).stdout

    out = run({})
    assert out.startswith("OK") and "mask-fill" in out, out
    assert "RAISED ['mask-fill']" in run({"KVPATCH_DISABLE": "mask-fill"})


# -- the problem finder, table-driven over synthetic records and facts ----------------------------------


def _patch(
    pid: str, affected: str = ">=0.22.0,<0.24.0", fixed_in: str | None = "0.24.0", checked: str | None = None
) -> Patch:
    return synthetic_patch(pid, affected=affected, fixed_in=fixed_in, checked=checked)


@pytest.mark.parametrize(
    ("version", "config", "imported", "state", "expect"),
    [
        ("0.23.2", Config(), [], None, []),  # pending, module never imported: nothing to say
        ("0.23.2", Config(), ["mlx_lm.models.base"], None, ["p: pending"]),  # imported yet not applied
        ("0.23.2", Config(), ["mlx_lm.models.base"], State.APPLIED, []),
        ("0.23.2", Config(enabled=False), [], None, ["p: disabled"]),
        ("0.23.2", Config(disabled_ids=frozenset({"p"})), [], None, ["p: disabled"]),
        ("0.23.2", Config(), ["mlx_lm.models.base"], State.FAILED, ["p: failed"]),
        ("0.23.2", Config(), ["mlx_lm.models.base"], State.DRIFTED, ["p: drifted"]),
        ("0.24.0", Config(), ["mlx_lm.models.base"], None, []),  # fixed upstream: not applicable
        ("0.21.0", Config(), ["mlx_lm.models.base"], None, []),  # predates the bug
        (None, Config(), [], None, []),  # not installed
    ],
)
def test_problems(version, config, imported, state, expect):
    engine = Engine([_patch("p")], upstream={"mlx-lm": Upstream("mlx-lm", version)}, config=config)
    if state is not None:
        engine.status["p"].state = state
    applicable, found = problems(engine, imported=imported)
    assert [f"{p.patch_id}: {p.state}" for p in found] == expect
    assert [s.patch.id for s in applicable] == (["p"] if version == "0.23.2" else [])


@pytest.mark.parametrize(
    ("state", "imported", "expect"),
    [
        (State.UNVERIFIED, ["mlx_lm.models.base"], ["v: pending verification"]),  # may be needed, not in
        (State.UNVERIFIED, [], []),  # its modules never imported: nothing to patch yet
        (State.INCONCLUSIVE, [], ["v: inconclusive"]),
        (State.NOT_NEEDED, ["mlx_lm.models.base"], []),  # the verdict says upstream is fine
        (State.APPLIED, ["mlx_lm.models.base"], []),
    ],
)
def test_problems_of_a_patch_left_to_its_verdict(state, imported, expect):
    patch = _patch("v", affected=">=0.28.0,<=0.30.0", fixed_in=None, checked="0.30.0")
    engine = Engine([patch], upstream={"mlx-lm": Upstream("mlx-lm", "0.31.0")})  # newer than checked_through
    engine.status["v"].state = state
    _, found = problems(engine, imported=imported)
    assert [f"{p.patch_id}: {p.state}" for p in found] == expect


def test_verify_that_failed_is_a_problem_and_broken_units_too():
    with pytest.warns(UserWarning, match="could not be loaded"):
        engine = _broken_engine()
    engine.status["v"].state = State.DRIFTED
    _, found = problems(engine, imported=[])
    assert [str(p).split(":")[0] for p in found] == ["v", "kvpatch.patches.bad"]
    assert "kvpatch.patches.bad: NOT FIXED: broken: SyntaxError: x" in str(NotApplied(found))


def _broken_engine() -> Engine:
    return Engine(
        [_patch("v", affected=">=0.28.0,<=0.30.0", fixed_in=None, checked="0.30.0")],
        upstream={"mlx-lm": Upstream("mlx-lm", "0.31.0")},  # newer than checked_through: VERIFY
        config=Config(),
        broken={"kvpatch.patches.bad": "SyntaxError: x"},
    )
