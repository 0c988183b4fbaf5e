"""The state vocabulary (``kvpatch/states.py``) is the one place a state's meaning lives: a state added without its
meaning, its rank, its wording or its line in docs/status.md fails here, and so does a mapping into the states that
misses a case."""

from __future__ import annotations

import re

from support import REPO

from kvpatch import states
from kvpatch.gate import Action
from kvpatch.states import MEANINGS, OF_ACTION, OF_VERDICT, VERIFY_CHECKS, WORDING, Check, Outcome, Reason, State, found
from kvpatch.verdicts import STORED

DOC = (REPO / "docs" / "status.md").read_text(encoding="utf-8")


def test_every_state_has_its_meaning():
    for state in State:
        meaning = MEANINGS[state]  # a KeyError: a state added without its meaning
        assert meaning.title and meaning.meaning and isinstance(meaning.rank, int), state
        assert isinstance(meaning.check, Check) and isinstance(meaning.unpatched, Check), state
        # a state that needs attention says why in a check line of its own wording; a clean one has none
        assert bool(meaning.line) == bool(meaning.check) and (not meaning.line or meaning.line in WORDING), state
        assert not (meaning.fixed and meaning.check), state  # where the bug cannot bite, nothing needs attention


def test_every_action_and_verdict_maps_to_a_state_and_a_wording():
    assert set(OF_ACTION) == set(Action)
    assert set(OF_VERDICT) == set(STORED)
    assert all(code in WORDING for _, code in OF_VERDICT.values())


def test_every_reason_the_runtime_gives_has_its_wording():
    """Each ``Reason("code", ...)`` in the runtime names a wording of the table, with the facts that wording needs."""
    runtime = [p for p in (REPO / "kvpatch").rglob("*.py") if "maint" not in p.parts and "patches" not in p.parts]
    used = {
        m for path in runtime for m in re.findall(r'Reason\(\s*"([a-z-]+)"\s*[,)]', path.read_text(encoding="utf-8"))
    }
    used |= {m.line for m in MEANINGS.values() if m.line} | {f"verify-{o.name}" for o in VERIFY_CHECKS}
    assert used and not used - set(WORDING), used - set(WORDING)
    assert str(Reason("check-failing", id="x", reason="why", state="failed", error=None)) == "x: why"


def test_a_wording_refuses_a_missing_fact():
    try:
        str(Reason("check-state", id="x"))
    except KeyError as exc:
        assert "state" in str(exc)
    else:
        raise AssertionError("a reason without the facts its wording names rendered")


def _table(heading: str) -> dict[str, tuple[str, ...]]:
    """The rows of the first table under ``heading`` in docs/status.md, by their first cell without backticks."""
    text = DOC[DOC.index(heading) :]
    table = text[text.index("\n| ") + 1 :].split("\n\n", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in table.splitlines()[2:]]
    assert rows, heading
    return {row[0].strip("`"): tuple(row[1:]) for row in rows}


def _check(meaning: states.Meaning) -> str:
    said = "clean" if meaning.check is Check.CLEAN else f"exit {meaning.check.value}"
    if meaning.unpatched > meaning.check:
        said += f"; exit {meaning.unpatched.value} where `--verify` finds the bug"
    return said


def test_docs_status_md_says_what_the_table_says():
    documented = _table("## States")
    assert documented == {state.value: (m.meaning, _check(m)) for state, m in MEANINGS.items()}
    findings = _table("### Findings of `--verify`")
    assert findings == {outcome.value: (f"exit {check.value}",) for outcome, check in VERIFY_CHECKS.items()}


def test_a_disabled_patch_is_the_user_s_choice():
    """``KVPATCH_DISABLE``: whatever ``--verify`` finds, ``--check`` stays clean (docs/status.md says so)."""
    disabled = MEANINGS[State.DISABLED]
    assert disabled.check is disabled.unpatched is Check.CLEAN and "your choice" in disabled.meaning


def test_a_finding_is_worded_with_its_own_facts():
    """What ``--verify`` found: whose code hid the bug, the state that left a present bug unpatched, what the run
    with the patch hit, the error that stopped the run."""
    elsewhere = found(Outcome.ELSEWHERE, "m.C.f: server.fix", state=State.APPLIED)
    assert str(elsewhere) == f"{Outcome.ELSEWHERE.value} (m.C.f: server.fix)"
    assert str(found(Outcome.UNPATCHED, "the bug", state=State.DISABLED)) == f"{Outcome.UNPATCHED.value} (disabled)"
    assert str(found(Outcome.INCONCLUSIVE, "d", tried="E: x")) == "inconclusive with the patch: E: x"
    assert str(found(Outcome.INCONCLUSIVE, "without the patch: E: y")) == "inconclusive without the patch: E: y"
    assert str(found(Outcome.SKIPPED, "Metal only")) == "skipped: Metal only"
    assert str(found(Outcome.COULD_NOT_RUN, "ImportError: z")) == "could not run: ImportError: z"
    assert str(found(Outcome.FIXED, "d", state=State.APPLIED)) == Outcome.FIXED.value
