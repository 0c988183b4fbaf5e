"""Table-driven tests of the pure gate: (patch, upstream facts, config) -> decision."""

from __future__ import annotations

import datetime as dt

import pytest

from kvpatch.commits import place
from kvpatch.config import Config, read_config
from kvpatch.detect import Source, Upstream
from kvpatch.gate import Action, decide
from kvpatch.record import Expiry, Patch, RecordError

EXPIRY = Expiry("test", review_by=dt.date(2030, 1, 1))
FIXED = Patch(
    id="fixed-bug",
    summary="a bug fixed in 0.6.0",
    distribution="mlx-vlm",
    affected=">=0.5.0,<0.6.0",
    fixed_in="0.6.0",
    fixed_commit="2a55b80b",
    introduced_commit="b0275383",
    reference="Blaizzy/mlx-vlm#1208",
    expiry=EXPIRY,
)
UNFIXED = Patch(
    id="open-bug",
    summary="a bug upstream has not fixed",
    distribution="mlx-lm",
    affected=">=0.28.0,<=0.32.2",
    checked_through="0.32.2",
    reference="not reported upstream",
    expiry=EXPIRY,
)
LM_FIXED = Patch(
    id="lm-fixed",
    summary="fixed in 0.24.0",
    distribution="mlx-lm",
    affected=">=0.22.0,<0.24.0",
    fixed_in="0.24.0",
    fixed_commit="a9e1e82c",
    reference="ml-explore/mlx-lm#121",
    expiry=EXPIRY,
)

INDEX = Source()
F96 = "f96138ee"  # before 2a55b80b, after b0275383
FEA = "fea81522"  # after 2a55b80b
INTRO_PARENT = None


def vcs(commit: str) -> Source:
    return Source(kind="vcs", url="https://github.com/Blaizzy/mlx-vlm", commit=commit)


NO_COMMIT = Patch(
    id="no-public-commit",
    summary="fixed in a release whose fix is not on the public main line",
    distribution="mlx-lm",
    affected=">=0.28.0,<0.32.0",
    fixed_in="0.32.0",
    reference="r",
    expiry=EXPIRY,
)
LM_PIN = Source(kind="vcs", url="https://github.com/ml-explore/mlx-lm", commit="a9e1e82c")

CASES = [
    (NO_COMMIT, "0.32.0", LM_PIN, Action.VERIFY),
    (NO_COMMIT, "0.31.0", INDEX, Action.APPLY),
    # (patch, version, source, expected action)
    (FIXED, "0.5.0", INDEX, Action.APPLY),
    (FIXED, "0.5.0.post1", INDEX, Action.APPLY),
    (FIXED, "0.5.0+local.1", INDEX, Action.APPLY),
    (FIXED, "0.6.0", INDEX, Action.NOT_NEEDED),
    (FIXED, "0.7.10", INDEX, Action.NOT_NEEDED),
    (FIXED, "0.6.0rc1", INDEX, Action.VERIFY),
    (FIXED, "0.6.0.dev3", INDEX, Action.VERIFY),
    (FIXED, "0.5.0rc1", INDEX, Action.OUT_OF_RANGE),
    (FIXED, "0.4.4", INDEX, Action.OUT_OF_RANGE),
    (FIXED, "0.5.0", vcs(F96), Action.APPLY),
    (FIXED, "0.5.0", vcs(FEA), Action.NOT_NEEDED),
    (FIXED, "0.6.0", vcs(F96), Action.APPLY),  # the commit wins over the declared version
    (FIXED, "0.5.0", vcs("0123456789abcdef0123456789abcdef01234567"), Action.VERIFY),
    (FIXED, "0.5.0", Source(kind="editable", url="file:///src/mlx-vlm"), Action.VERIFY),
    (FIXED, "0.6.0", Source(kind="editable", url="file:///src/mlx-vlm"), Action.VERIFY),
    (FIXED, "0.6.1", Source(kind="editable", url="file:///src/mlx-vlm"), Action.NOT_NEEDED),
    (FIXED, "0.5.0", Source(kind="directory", url="file:///src/mlx-vlm"), Action.VERIFY),
    (FIXED, "0.5.0", Source(kind="archive", url="file:///x.tar.gz"), Action.VERIFY),
    (FIXED, "0.5.0", Source(kind="unknown", error="broken"), Action.VERIFY),
    (FIXED, "not-a-version", INDEX, Action.VERIFY),
    (UNFIXED, "0.28.0", INDEX, Action.APPLY),
    (UNFIXED, "0.32.2", INDEX, Action.APPLY),
    (UNFIXED, "0.32.2.dev0", INDEX, Action.APPLY),
    (UNFIXED, "0.27.1", INDEX, Action.OUT_OF_RANGE),
    (UNFIXED, "0.32.3", INDEX, Action.VERIFY),  # newer than checked: reproduction decides
    (UNFIXED, "0.33.0rc1", INDEX, Action.VERIFY),
    (LM_FIXED, "0.23.2", INDEX, Action.APPLY),
    (LM_FIXED, "0.24.0", INDEX, Action.NOT_NEEDED),
    (LM_FIXED, "0.24.0rc0", INDEX, Action.VERIFY),
    (LM_FIXED, "0.21.5", INDEX, Action.OUT_OF_RANGE),
]


@pytest.mark.parametrize(
    ("patch", "version", "source", "expected"), CASES, ids=[f"{c[0].id}-{c[1]}-{c[2].kind}" for c in CASES]
)
def test_decide(patch, version, source, expected):
    decision = decide(patch, Upstream(patch.distribution, version, source), Config())
    assert decision.action is expected, decision.reason
    assert decision.reason  # always a human reason


def test_not_installed_and_switches():
    assert decide(FIXED, Upstream("mlx-vlm", None), Config()).action is Action.NOT_INSTALLED
    up = Upstream("mlx-vlm", "0.5.0")
    assert decide(FIXED, up, Config(enabled=False)).action is Action.DISABLED
    assert decide(FIXED, up, read_config({"KVPATCH_DISABLE": "fixed-bug"})).action is Action.DISABLED
    assert decide(FIXED, up, read_config({"KVPATCH_DISABLE": "*"})).action is Action.DISABLED
    assert decide(FIXED, up, read_config({"KVPATCH_DISABLE": "other"})).action is Action.APPLY


@pytest.mark.parametrize("why", ["METADATA missing", "METADATA empty", "METADATA unreadable: UnicodeDecodeError: ..."])
@pytest.mark.parametrize("patch", [FIXED, UNFIXED, LM_FIXED], ids=lambda p: p.id)
def test_installed_version_unknown_is_verify(patch, why):
    """Importable but no readable version: never "not installed"; the reproduction decides."""
    up = Upstream(patch.distribution, None, Source(), version_unknown=why)
    assert up.installed
    d = decide(patch, up, Config())
    assert d.action is Action.VERIFY
    assert "installed, version unknown" in d.reason and why in d.reason and "reproduction decides" in d.reason


def test_version_unknown_git_pin_is_still_placed():
    """A git pin whose METADATA is unreadable is still placed by its commit."""
    up = Upstream("mlx-vlm", None, vcs(FEA), version_unknown="METADATA missing")
    assert decide(FIXED, up, Config()).action is Action.NOT_NEEDED


def test_reasons_name_the_facts():
    d = decide(FIXED, Upstream("mlx-vlm", "0.5.0", vcs(FEA)), Config())
    assert "fea81522" in d.reason
    d = decide(UNFIXED, Upstream("mlx-lm", "0.33.0"), Config())
    assert "0.32.2" in d.reason and "reproduction decides" in d.reason


def test_broken_placer_is_verify_not_crash(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("index corrupt")

    monkeypatch.setattr("kvpatch.commits.place", broken)
    d = decide(FIXED, Upstream("mlx-vlm", "0.5.0", vcs(F96)), Config())
    assert d.action is Action.VERIFY and "index corrupt" in d.reason


def test_known_pins_against_real_index():
    assert place("mlx-vlm", F96, fixed_commit="2a55b80b").fixed is False
    assert place("mlx-vlm", FEA, fixed_commit="2a55b80b").fixed is True


@pytest.mark.parametrize(
    "kwargs",
    [
        {"id": "Bad Id"},
        {"id": "a,b"},
        {"distribution": "numpy"},
        {"affected": "not a range"},
        {"fixed_in": "0.5.5"},  # inside the affected range
        {"fixed_in": "x.y"},
        {"affected": ">=0.5.0"},  # open range: would apply blindly to every future release
        {"affected": ">=0.5.0", "checked_through": "0.6.0"},
        {"affected": ">=0.5.0,<=0.6.0", "fixed_in": None},  # unfixed without checked_through
    ],
)
def test_bad_records_are_rejected(kwargs):
    base = dict(
        id="ok",
        summary="s",
        distribution="mlx-vlm",
        affected=">=0.5.0,<0.6.0",
        reference="r",
        expiry=EXPIRY,
    )
    base.update(kwargs)
    with pytest.raises(RecordError):
        Patch(**base)


def test_target_outside_upstream_is_rejected():
    p = Patch(
        id="t", summary="s", distribution="mlx-lm", affected=">=0.1,<0.2", fixed_in="0.2", reference="r", expiry=EXPIRY
    )
    with pytest.raises(RecordError):
        p.replace("os.path", "join")


def test_no_hook_registry_means_failed_not_pending(monkeypatch):
    """The bootstrap's hook registry does not load: no hook will ever fire, so a patch that would apply is
    reported failed with the reason, never left pending (an outcome, not a prediction)."""
    import kvpatch.engine as engine_module
    from kvpatch.config import Config
    from kvpatch.detect import Upstream
    from kvpatch.engine import Engine, State

    def hook_registry():
        raise ImportError("kvpatch's post-import hooks (_kvpatch_hooks) cannot be loaded: reinstall kvpatch")

    monkeypatch.setattr(engine_module, "hook_registry", hook_registry)
    p = Patch(
        id="t-hook",
        summary="s",
        distribution="mlx-lm",
        affected=">=0.1,<0.3",
        fixed_in="0.3",
        reference="r",
        expiry=EXPIRY,
    )
    p.replace("mlx_lm.models.cache", "KVCache.update_and_fetch")(lambda original: original)
    p.reproduce(lambda: None)
    eng = Engine([p], upstream={"mlx-lm": Upstream("mlx-lm", "0.2")}, config=Config())
    assert eng.status["t-hook"].state is State.PENDING
    with pytest.warns(Warning):
        eng.activate()
    st = eng.status["t-hook"]
    assert st.state is State.FAILED and "could not activate" in st.reason and "_kvpatch_hooks" in st.reason, st.reason
    assert not eng.active
