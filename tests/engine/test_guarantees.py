"""``kvpatch.require`` / ``kvpatch.is_fixed`` (kvpatch.assertions' per-fix guarantees), table-driven over
synthetic records and facts. The run on real releases is tests/upstream/test_guarantees_upstream.py."""

from __future__ import annotations

import pytest
from support import synthetic_patch

import kvpatch
from kvpatch.assertions import Guarantee, NotFixed, UnknownPatch, guarantees
from kvpatch.config import Config
from kvpatch.detect import Upstream
from kvpatch.engine import Engine, State
from kvpatch.record import Target


def _engine(version, config=None, *, opt_in=False, broken=None):
    patch = synthetic_patch("p", opt_in=opt_in)  # targets mlx_lm.models.base: not importable here
    return Engine([patch], upstream={"mlx-lm": Upstream("mlx-lm", version)}, config=config or Config(), broken=broken)


@pytest.mark.parametrize(
    ("version", "config", "opt_in", "state", "fixed", "shown"),
    [
        ("0.23.2", Config(), False, State.APPLIED, True, "applied"),
        ("0.24.0", Config(), False, None, True, "not needed"),  # fixed upstream
        ("0.21.0", Config(), False, None, True, "out of range"),  # predates the bug
        (None, Config(), False, None, True, "not installed"),  # nothing to fix
        # off: counts only where upstream has no such bug
        ("0.23.2", Config(disabled_ids=frozenset({"p"})), False, None, False, "disabled"),
        ("0.24.0", Config(disabled_ids=frozenset({"p"})), False, None, True, "disabled"),
        ("0.23.2", Config(enabled=False), False, None, False, "disabled"),
        ("0.21.0", Config(enabled=False), False, None, True, "disabled"),
        # an opt-in patch that was not asked for does not fix the bug
        ("0.23.2", Config(), True, None, False, "opt-in"),
        ("0.24.0", Config(), True, None, True, "not needed"),
        # in range, its module cannot be imported: not installed, so not fixed
        ("0.23.2", Config(), False, None, False, "pending"),
        ("0.23.2", Config(), False, State.OVERRIDDEN, False, "overridden"),
        ("0.23.2", Config(), False, State.FAILED, False, "failed"),
        ("0.23.2", Config(), False, State.DRIFTED, False, "drifted"),
        ("0.23.2", Config(), False, State.UNVERIFIED, False, "pending verification"),
        ("0.23.2", Config(), False, State.INCONCLUSIVE, False, "inconclusive"),
    ],
)
def test_guarantee_table(version, config, opt_in, state, fixed, shown):
    engine = _engine(version, config, opt_in=opt_in)
    if state is not None:
        engine.status["p"].state = state
    (g,) = guarantees(engine, ["p"])
    assert (g.fixed, g.state) == (fixed, shown), g
    assert g.reason


def test_disabled_reason_says_why_the_bug_is_not_ruled_out():
    (g,) = guarantees(_engine("0.23.2", Config(disabled_ids=frozenset({"p"}))), ["p"])
    assert "KVPATCH_DISABLE names p" in g.reason and "affected range" in g.reason, g
    (g,) = guarantees(_engine("0.24.0", Config(disabled_ids=frozenset({"p"}))), ["p"])
    assert "not needed" in g.reason and "0.24.0" in g.reason, g


def test_suspended_patch_is_not_fixed():
    engine = _engine("0.23.2")
    engine.status["p"].state = State.APPLIED
    engine.status["p"].suspended = True
    (g,) = guarantees(engine, ["p"])
    assert not g.fixed and g.state == "suspended", g


def test_unknown_id_suggests_close_matches():
    engine = _engine("0.23.2")
    engine.status["batch-logits-processors"] = engine.status["p"]
    with pytest.raises(UnknownPatch, match=r"'batch-logit-processors'; did you mean 'batch-logits-processors'\?") as e:
        guarantees(engine, ["p", "batch-logit-processors"])
    assert e.value.suggestions == ["batch-logits-processors"]
    with pytest.raises(UnknownPatch) as e:
        guarantees(engine, ["zzz"])
    assert "did you mean" not in str(e.value)


def test_broken_unit_is_not_fixed_and_not_unknown():
    with pytest.warns(UserWarning, match="could not be loaded"):
        engine = _engine("0.23.2", broken={"kvpatch.patches.mlx_lm.some_fix": "SyntaxError: x"})
    (g,) = guarantees(engine, ["some-fix"])
    assert not g.fixed and g.state == "broken" and "SyntaxError: x" in g.reason, g
    with pytest.warns(UserWarning, match="could not be loaded"):
        engine = _engine("0.23.2", broken={"kvpatch.patches.mlx_vlm.offset_detach": "SyntaxError: y"})
    (g,) = guarantees(engine, ["offset-detach-vlm"])  # the file name drops the folder's "vlm"
    assert not g.fixed and g.state == "broken" and "SyntaxError: y" in g.reason, g


def test_not_fixed_message_lists_every_id_with_state_and_reason():
    err = NotFixed(
        [Guarantee("a", True, "applied", "in range"), Guarantee("b", False, "disabled", "KVPATCH_DISABLE names b")]
    )
    text = str(err)
    assert "1 required fix(es) not in effect" in text
    assert "  - a: ok: applied: in range" in text and "  - b: NOT FIXED: disabled: KVPATCH_DISABLE names b" in text
    assert [g.patch_id for g in err.problems] == ["b"]


def test_public_api_in_this_process():
    """This process's engine (no mlx installed here: every mlx patch is 'not installed', so fixed)."""
    for name in ("require", "is_fixed", "NotFixed", "UnknownPatch", "bounded_prompt_cache"):
        assert name in kvpatch.__all__ and getattr(kvpatch, name) is not None
    ids = [st.patch.id for st in kvpatch.records()]
    with pytest.raises(TypeError):
        kvpatch.require()
    with pytest.raises(kvpatch.UnknownPatch):
        kvpatch.require(ids[0], "no-such-fix")
    with pytest.raises(kvpatch.UnknownPatch):
        kvpatch.is_fixed("no-such-fix")
    if not any(st.state is State.NOT_INSTALLED for st in kvpatch.records()):
        pytest.skip("mlx-lm / mlx-vlm are installed here")
    assert all(g.fixed for g in kvpatch.require(*ids))
    assert kvpatch.is_fixed(ids[0]) is True


def test_a_target_module_raising_on_import_leaves_the_patch_pending(tmp_path, monkeypatch):
    """The pending patches' target modules are imported the engine's one way: a module whose import raises (not an
    ImportError: some raise without Metal) leaves its patch pending and not fixed, never raised to the caller."""
    (tmp_path / "kvpatch_raises_on_import.py").write_text("raise RuntimeError('no Metal here')\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    engine = _engine("0.23.2")
    engine.status["p"].record.targets[:] = [Target("kvpatch_raises_on_import", "f")]
    (g,) = guarantees(engine, ["p"])
    assert (g.fixed, g.state) == (False, "pending"), g
