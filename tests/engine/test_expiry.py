"""Expiry and upstream-removal checks: the real registry against the supported floor and review-by dates,
and table-driven tests of the expiry logic, of ``upstream-check``'s verdicts, and of the retired list.

``test_no_patch_is_expired_for_every_supported_release`` always fails on a dead patch (fixed in every
supported release). ``test_no_review_by_date_has_passed`` fails only under ``KVPATCH_ENFORCE=1`` (CI);
otherwise it warns.
"""

from __future__ import annotations

import datetime as dt
import sys
import warnings

import pytest
from matrix import LM_BUCKETS, VLM_BUCKETS
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kvpatch import registry
from kvpatch.config import read_config
from kvpatch.engine import KvpatchWarning
from kvpatch.maint.expiry import SUPPORTED_FLOOR, Reason, evaluate, expired, expiry_reasons, failing, patch_file
from kvpatch.maint.retired import Retired, render_retired
from kvpatch.maint.upstream_check import (
    Expect,
    Measured,
    Outcome,
    Release,
    Row,
    absent_advice,
    expectation,
    format_text,
    judge,
    newest,
    relevant,
    requirement_on,
)
from kvpatch.record import Expiry, Patch

PATCHES = registry.load().patches
TODAY = dt.date(2026, 11, 21)


# -- the real registry ---------------------------------------------------------------------------------


def test_supported_floor_is_the_oldest_matrix_bucket():
    oldest = {
        "mlx-lm": min((b.version("mlx-lm") for b in LM_BUCKETS), key=Version),
        "mlx-vlm": min((b.version("mlx-vlm") for b in VLM_BUCKETS), key=Version),
    }
    assert oldest == SUPPORTED_FLOOR


def test_no_patch_is_expired_for_every_supported_release():
    dead = [e for e in expired(PATCHES) if e.reason is Reason.FIXED_EVERYWHERE]
    assert not dead, "\n".join(e.message for e in dead)


def test_no_review_by_date_has_passed():
    overdue = [e for e in expired(PATCHES) if e.reason is Reason.REVIEW_BY]
    if overdue and read_config().enforce:
        pytest.fail("KVPATCH_ENFORCE=1:\n" + "\n".join(e.message for e in overdue))
    for e in overdue:
        warnings.warn(e.message, KvpatchWarning, stacklevel=1)


def test_every_record_has_a_review_by_date_or_a_fix():
    missing = [patch_file(p) for p in PATCHES if p.fixed_in is None and p.expiry.review_by is None]
    assert not missing, f"unfixed patches need Expiry(review_by=...): {missing}"


# -- expiry logic over synthetic records ---------------------------------------------------------------


def _patch(
    dist: str = "mlx-lm",
    affected: str = ">=0.20.0,<0.24.0",
    fixed_in: str | None = "0.24.0",
    checked: str | None = None,
    review_by: dt.date | None = dt.date(2027, 6, 1),
    module: str = "kvpatch.patches.mlx_lm.some_fix",
) -> Patch:
    p = Patch(
        id="some-fix",
        summary="synthetic",
        distribution=dist,
        affected=affected,
        fixed_in=fixed_in,
        checked_through=checked,
        reference="not reported upstream",
        expiry=Expiry("retire when ...", review_by=review_by),
    )
    p.module = module
    return p


@pytest.mark.parametrize(
    ("patch", "today", "floor", "expect"),
    [
        (_patch(fixed_in="0.24.0"), TODAY, {"mlx-lm": "0.22.0"}, []),
        (_patch(fixed_in="0.24.0"), TODAY, {"mlx-lm": "0.24.0"}, [Reason.FIXED_EVERYWHERE]),
        (_patch(fixed_in="0.24.0"), TODAY, {"mlx-lm": "0.28.0"}, [Reason.FIXED_EVERYWHERE]),
        (_patch(fixed_in="0.24.0"), TODAY, {"mlx-lm": "0.24.0rc1"}, []),
        (_patch(fixed_in="0.24.0"), TODAY, {}, []),  # no floor for the distribution: never (a)
        (_patch(dist="mlx-vlm", affected=">=0.5.0,<0.6.0", fixed_in="0.6.0"), TODAY, SUPPORTED_FLOOR, []),
        (
            _patch(dist="mlx-vlm", affected=">=0.4.0,<0.4.3", fixed_in="0.4.3"),
            TODAY,
            SUPPORTED_FLOOR,
            [Reason.FIXED_EVERYWHERE],
        ),
        (_patch(affected=">=0.28.0,<=0.32.2", fixed_in=None, checked="0.32.2"), TODAY, SUPPORTED_FLOOR, []),
        (
            _patch(fixed_in=None, affected=">=0.28.0,<=0.32.2", checked="0.32.2", review_by=dt.date(2026, 11, 20)),
            TODAY,
            SUPPORTED_FLOOR,
            [Reason.REVIEW_BY],
        ),
        (
            _patch(fixed_in=None, affected=">=0.28.0,<=0.32.2", checked="0.32.2", review_by=TODAY),
            TODAY,
            SUPPORTED_FLOOR,
            [],
        ),  # due, not past
        (
            _patch(fixed_in=None, affected=">=0.28.0,<=0.32.2", checked="0.32.2", review_by=None),
            TODAY,
            SUPPORTED_FLOOR,
            [],
        ),
        (
            _patch(fixed_in="0.24.0", review_by=dt.date(2020, 1, 1)),
            TODAY,
            {"mlx-lm": "0.30.0"},
            [Reason.FIXED_EVERYWHERE, Reason.REVIEW_BY],
        ),
    ],
)
def test_evaluate(patch, today, floor, expect):
    assert [e.reason for e in evaluate(patch, today, floor)] == expect


def test_messages_name_the_file_field_and_value():
    dead = _patch(fixed_in="0.24.0", module="kvpatch.patches.mlx_lm.mask_fill")
    [e] = evaluate(dead, TODAY, {"mlx-lm": "0.24.0"})
    assert (
        "delete kvpatch/patches/mlx_lm/mask_fill.py" in e.message and "RETIRED in kvpatch/maint/retired.py" in e.message
    )
    late = _patch(
        fixed_in=None,
        affected=">=0.28.0,<=0.32.2",
        checked="0.32.2",
        review_by=dt.date(2026, 1, 1),
        module="kvpatch.patches.mlx_lm.x_y",
    )
    [e] = evaluate(late, TODAY)
    assert "2026-01-01" in e.message and "Expiry(review_by=...) in kvpatch/patches/mlx_lm/x_y.py" in e.message
    assert "`python -m kvpatch upstream-check`" in e.message and "`python -m kvpatch.maint.regenerate`" in e.message
    assert expiry_reasons([late], TODAY) == [e.message]


def test_enforcement_policy():
    late = _patch(fixed_in=None, affected=">=0.28.0,<=0.32.2", checked="0.32.2", review_by=dt.date(2026, 1, 1))
    dead = _patch(dist="mlx-vlm", affected=">=0.4.0,<0.4.3", fixed_in="0.4.3")
    assert [e.reason for e in failing([late, dead], enforce=False, today=TODAY)] == [Reason.FIXED_EVERYWHERE]
    assert [e.reason for e in failing([late, dead], enforce=True, today=TODAY)] == [
        Reason.REVIEW_BY,
        Reason.FIXED_EVERYWHERE,
    ]


def test_patch_file_without_module_falls_back_to_the_id():
    assert patch_file(_patch(module="")) == "kvpatch/patches/mlx_lm/some_fix.py"


# -- upstream-check: what the record expects and whether a measurement agrees ---------------------------

OPEN = _patch(affected=">=0.28.0,<=0.32.2", fixed_in=None, checked="0.32.2", module="kvpatch.patches.mlx_lm.open_bug")
FIXED = _patch(affected=">=0.22.0,<0.24.0", fixed_in="0.24.0", module="kvpatch.patches.mlx_lm.fixed_bug")


@pytest.mark.parametrize(
    ("patch", "release", "expect"),
    [
        (OPEN, "0.27.1", Expect.NOT_RELEVANT),  # predates the range
        (OPEN, "0.28.0", Expect.NEEDED),
        (OPEN, "0.32.2", Expect.NEEDED),
        (OPEN, "0.32.3", Expect.NEWER),
        (OPEN, "0.33.0.dev0", Expect.NEWER),
        (FIXED, "0.23.2", Expect.NEEDED),
        (FIXED, "0.24.0", Expect.ABSENT),
        (FIXED, "0.24.0.post1", Expect.ABSENT),
        (FIXED, "0.24.0rc1", Expect.UNSETTLED),
        (FIXED, "0.24.1", Expect.NOT_RELEVANT),  # the range ended before this release
        (FIXED, "0.32.2", Expect.NOT_RELEVANT),
        (FIXED, "0.21.0", Expect.NOT_RELEVANT),
    ],
)
def test_expectation(patch, release, expect):
    assert expectation(patch, release) is expect


def test_relevant_needs_the_distribution_checked():
    assert relevant(OPEN, {"mlx-lm": "0.32.2"})
    assert not relevant(OPEN, {"mlx-vlm": "0.7.10"})
    assert not relevant(FIXED, {"mlx-lm": "0.32.2"})


@pytest.mark.parametrize(
    ("patch", "release", "measured", "kwargs", "agrees", "advice"),
    [
        (OPEN, "0.32.2", Measured.NEEDED, {}, True, []),
        (OPEN, "0.32.2", Measured.NEEDED, {"patched_fixes": True}, True, []),
        (
            OPEN,
            "0.33.0",
            Measured.NEEDED,
            {},
            True,
            ["checked_through '0.32.2' -> '0.33.0'", "affected '>=0.28.0,<=0.32.2' -> '>=0.28.0,<=0.33.0'"],
        ),
        (OPEN, "0.33.0", Measured.NEEDED, {"patched_fixes": False, "patched_state": "drifted"}, False, ["rework"]),
        (
            OPEN,
            "0.33.0",
            Measured.FIXED,
            {"first_fixed": "0.32.3"},
            False,
            ["fixed_in='0.32.3'", "affected='>=0.28.0,<0.32.3'", "checked_through=None", "mlx-lm < 0.32.3"],
        ),
        (OPEN, "0.33.0", Measured.FIXED, {}, False, ["fixed_in='0.33.0'"]),
        (OPEN, "0.32.2", Measured.FIXED, {}, False, ["says mlx-lm 0.32.2 is affected", "fixed_in='0.32.2'"]),
        (OPEN, "0.33.0", Measured.FIXED, {"local": True}, False, ["local mlx-lm build"]),
        (OPEN, "0.33.0", Measured.MOVED, {}, False, ["retarget", "kvpatch/patches/mlx_lm/open_bug.py"]),
        (OPEN, "0.33.0", Measured.COULD_NOT_RUN, {}, False, ["could not run"]),
        (OPEN, "0.33.0", Measured.COULD_NOT_RUN, {"skipped": True}, None, []),
        (OPEN, "0.33.0", Measured.INCONCLUSIVE, {}, False, ["inconclusive", "not a record error"]),
        (OPEN, "0.32.2", Measured.INCONCLUSIVE, {}, False, ["inconclusive", "not a record error"]),
        (OPEN, "0.27.0", Measured.NOT_RELEVANT, {}, None, []),
        (FIXED, "0.24.0", Measured.FIXED, {}, True, []),
        (FIXED, "0.24.0", Measured.NEEDED, {}, False, ["fixed_in='0.24.0' but the bug reproduces"]),
        (FIXED, "0.24.0", Measured.NEEDED, {"local": True}, True, []),  # a tree declaring 0.24.0 may predate the fix
        (
            FIXED,
            "0.24.0",
            Measured.NEEDED,
            {"local": True, "patched_fixes": False, "patched_state": "not needed"},
            False,
            ["the fix is not in this tree yet"],
        ),
        (FIXED, "0.23.2", Measured.NEEDED, {}, True, []),
        (FIXED, "0.32.2", Measured.FIXED, {}, None, []),
    ],
)
def test_judge(patch, release, measured, kwargs, agrees, advice):
    verdict = judge(patch, release, measured, **kwargs)
    assert verdict.agrees is agrees, verdict
    text = "\n".join(verdict.advice)
    for fragment in advice:
        assert fragment in text, text
    if not advice:
        assert not verdict.advice


@pytest.mark.parametrize("patch", [OPEN, FIXED], ids=["open", "fixed"])
@pytest.mark.parametrize("release", ["0.23.2", "0.24.0", "0.28.0", "0.32.2", "0.33.0"])
def test_inconclusive_never_advises_a_record_edit(patch, release):
    """An error that is not the bug's symptom says nothing about the record: no field to set, bump or widen."""
    verdict = judge(patch, release, Measured.INCONCLUSIVE)
    text = "\n".join(verdict.advice)
    for word in ("set ", "bump", "widen", "fixed_in=", "affected="):
        assert word not in text, text


def test_an_inconclusive_child_result_is_measured_inconclusive():
    from kvpatch.maint.upstream_check import _measure_one

    finding = {"present": False, "detail": "", "skipped": None, "inconclusive": "RuntimeError: no kernel"}
    measured, detail, skipped = _measure_one({"finding": finding, "missing": [], "exists": [], "deps": []}, None)
    assert measured is Measured.INCONCLUSIVE and "no kernel" in detail and not skipped


def test_newest_skips_fresh_and_pre_releases():
    now = dt.datetime(2026, 11, 21, 12, tzinfo=dt.timezone.utc)
    hours = lambda h: now - dt.timedelta(hours=h)  # noqa: E731
    releases = [
        Release("0.32.2", hours(24 * 30)),
        Release("0.33.0rc1", hours(24 * 3)),
        Release("0.33.0", hours(5)),
        Release("0.32.10", hours(24 * 2 + 1)),
    ]
    best, notes = newest(releases, now=now)
    assert best.version == "0.32.10" and notes == ["ignored 0.33.0 (uploaded 5 h ago; --include-fresh checks it)"]
    assert newest(releases, now=now, include_fresh=True)[0].version == "0.33.0"
    assert newest(releases, now=now, spec=SpecifierSet("<0.32.5"))[0].version == "0.32.2"
    assert newest([Release("0.1.0")], now=now)[0].version == "0.1.0"  # no upload date: taken
    assert newest([], now=now) == (None, [])


@pytest.mark.parametrize(
    ("requires", "dependency", "expect"),
    [
        # mlx-lm 0.32.2's Requires-Dist (Linux CPU: the extra; macOS: the plain one)
        (['mlx>=0.32.2; platform_system == "Darwin"', 'mlx[cpu]>=0.32.2; extra == "cpu"'], "mlx", ">=0.32.2"),
        (["mlx>=0.32.4", 'mlx-cpu; extra == "cpu"'], "mlx", ">=0.32.4"),  # mlx-vlm 0.7.10
        (["mlx>=0.22.0", "numpy"], "mlx", ">=0.22.0"),  # mlx-lm 0.22.0
        (["mlx-lm>=0.31.3", "mlx>=0.32.0"], "mlx-lm", ">=0.31.3"),
        (["numpy"], "mlx", None),
        (['mlx[cuda13]>=0.32.2; extra == "cuda13"'], "mlx", None),
    ],
)
def test_requirement_on(requires, dependency, expect):
    spec = requirement_on(requires, dependency)
    assert (str(spec) if spec is not None else None) == expect


# -- the retired list ----------------------------------------------------------------------------------


def test_render_retired_empty_and_filled():
    empty = render_retired(())
    assert empty.startswith("## Retired patches\n") and "pin kvpatch to the last release" in empty
    assert "None yet" in empty
    one = render_retired((Retired("mask-fill", "A1+A2", "mlx-lm", "0.24.0", "0.4.0", "quantized SDPA mask"),))
    assert "| `mask-fill` | A1+A2 | mlx-lm | 0.24.0 | 0.4.0 | quantized SDPA mask |" in one


def test_retired_ids_are_not_in_the_registry():
    from kvpatch.maint.retired import RETIRED

    assert not {r.id for r in RETIRED} & {p.id for p in PATCHES}


# -- upstream-check end to end ---------------------------------------------------------------------------


def test_cli_has_upstream_check():
    from kvpatch.cli import build_parser

    args = build_parser().parse_args(["upstream-check", "--mlx-lm", "0.32.2", "--mlx-vlm", "none", "--json"])
    assert (args.mlx_lm, args.mlx_vlm, args.json, args.include_fresh) == ("0.32.2", "none", True, False)


@pytest.mark.slow
@pytest.mark.skipif(sys.version_info < (3, 11), reason="mlx-lm 0.32.2 needs Python 3.11")
def test_upstream_check_on_a_pinned_release(tmp_path):
    """A real run (layers cached like the matrix): every relevant patch is measured, none fails to run."""
    import json
    import subprocess
    import sys

    from support import child_env

    proc = subprocess.run(
        [sys.executable, "-m", "kvpatch", "upstream-check", "--mlx-lm", "0.32.2", "--mlx-vlm", "none", "--json"],
        cwd=tmp_path,
        env=child_env({"PYTHONPATH": _repo()}),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode in (0, 1), proc.stderr
    data = json.loads(proc.stdout)
    assert data["schema"] == "kvpatch.upstream-check/1"
    if "error" in data and data["error"].startswith("cannot list releases"):
        # (an offline host, e.g. a GPU machine with no package index: the check has nothing to install from)
        pytest.skip(f"upstream-check needs a package index and none is reachable here: {data['error'][:300]}")
    assert data["checked"][0]["version"] == "0.32.2"
    rows = [p for p in data["patches"] if p["measured"] != "not relevant"]
    assert rows, "no patch is relevant on mlx-lm 0.32.2"
    broken = [p for p in rows if p["measured"] == "could not run" and not p["detail"].startswith("skipped")]
    assert not broken, json.dumps(broken, indent=1)
    for p in rows:
        if p["measured"] == "still needed":
            assert p["with_patch"] and "bug fixed by the patch" in p["with_patch"], p


def _repo() -> str:
    from support import REPO

    return str(REPO)


# -- what to change when the bug is absent without the patch on an affected release ---------------------------


@pytest.mark.parametrize(
    ("release", "commit", "says"),
    [
        (
            "0.28.0",
            None,
            "is the lower bound of affected='>=0.28.0,<=0.32.2' but has no bug: if the bug came later, raise",
        ),
        ("0.32.2", None, "set fixed_in='0.32.2'"),
        ("0.32.2", None, "set affected='>=0.28.0,<0.32.2'"),
        ("0.30.2", None, "lies inside affected='>=0.28.0,<=0.32.2' but has no bug: the reproduction misses it"),
        ("0.30.2", "abcdef0123", "if abcdef01 predates the bug, set introduced_commit"),
    ],
)
def test_absent_advice_names_the_field_for_where_the_release_sits(release, commit, says):
    advice = absent_advice(OPEN, release, commit=commit)
    assert any(says in line for line in advice), advice
    assert advice[0].startswith("kvpatch/patches/mlx_lm/open_bug.py: ")
    assert advice[-1] == "after changing the record: `python -m kvpatch.maint.regenerate --only some-fix`"


def test_disagreeing_records_point_at_the_one_regeneration_command():
    row = Row(FIXED, "0.23.2", "env", Measured.FIXED)
    row.agreement = judge(FIXED, "0.23.2", Measured.FIXED)
    outcome = Outcome([], [], [row], [], 1.0)
    text = format_text(outcome)
    assert "(change them, then `python -m kvpatch.maint.regenerate`)" in text and "compat --write" not in text
