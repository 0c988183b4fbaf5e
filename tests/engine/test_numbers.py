"""kvpatch.patches._numbers without mlx: a difference against its rounding, and a verdict judged against the bug's
size (present only when clear, absent when within, inconclusive in between; structure decides alone)."""

from __future__ import annotations

import math

import pytest

from kvpatch.patches._numbers import CLEAR, Difference, judge, worst


def test_within_clear_and_between():
    assert Difference(0.0, 1.0).within and not Difference(0.0, 1.0).clear
    assert Difference(1.0, 1.0).within
    between = Difference(2.0, 1.0)
    assert not between.within and not between.clear
    assert Difference(CLEAR + 1, 1.0).clear
    assert Difference(math.nan, 1.0).clear and Difference(math.nan, 1.0).ratio == math.inf


def test_worst_is_the_furthest_above_its_rounding():
    small_but_far = Difference(1.0, 0.01, "a")
    large_but_near = Difference(5.0, 10.0, "b")
    assert worst([large_but_near, small_but_far]) is small_but_far
    assert worst([]) is None


@pytest.mark.parametrize(
    ("found", "problems", "bug", "sizes"),
    [
        (Difference(CLEAR * 2, 1.0), (), "present", True),
        (Difference(0.5, 1.0), (), "absent", True),
        (Difference(CLEAR / 2, 1.0), (), "inconclusive", True),
        # a structural problem decides alone; the difference then is no size of the bug
        (Difference(0.0, 1.0), ("offset [0, 5], expected [0, 3]",), "present", False),
        (Difference(CLEAR / 2, 1.0), ("raises ValueError",), "present", False),
        (Difference(CLEAR * 2, 1.0), ("raises ValueError",), "present", True),
        (None, ("raises ValueError",), "present", False),
        (None, (), "absent", False),
    ],
)
def test_judge(found, problems, bug, sizes):
    finding = judge(found, "rows differ", "rows equal", problems=problems)
    assert finding.bug.value == bug, finding
    assert (finding.error is not None) == sizes, finding
    if sizes:
        assert (finding.error, finding.rounding) == (found.error, found.rounding)
    if bug == "inconclusive":
        assert "neither the bug nor its absence" in finding.inconclusive
    for problem in problems:
        assert problem in finding.detail
