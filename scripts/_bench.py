"""Shared by the benchmarks in scripts/: alternating A/B rounds and the confidence interval of their ratio.

A round runs both sides once, back to back (which side goes first alternates), so slow drifts of the
machine (clocks, other processes) hit both sides of a round alike. The ratio of a round is patched /
unpatched throughput; the reported ratio is the geometric mean over rounds, with a two-sided 95%
Student-t interval on the mean log ratio. ``run_until`` adds rounds until that interval is narrower than
asked (or a round or time limit is reached), so a reported ratio always comes with its width.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

# two-sided 95% quantiles of Student's t by degrees of freedom (1..30); beyond 30 the normal 1.96 is
# within 2% of the true quantile
_T95 = [
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
]  # fmt: skip


def hot_path_ids(engine: Any, chosen: list[str] | None = None) -> list[str]:
    """The patch ids a benchmark toggles: ``chosen`` (``--patch``), else every hot-path patch installed here."""
    return chosen or [pid for pid, st in engine.status.items() if st.installed and st.record.hot_path]


def t95(df: int) -> float:
    if df < 1:
        return math.inf
    return _T95[df - 1] if df <= len(_T95) else 1.96 + 2.4 / df  # (the 1/df term tracks t within 0.1%)


@dataclass
class Paired:
    """Throughputs of the two sides, one entry per round."""

    on: list[float] = field(default_factory=list)
    off: list[float] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.on)

    def ratio(self) -> tuple[float, float, float]:
        """(geometric-mean ratio on/off, 95% CI low, 95% CI high)."""
        logs = [math.log(a / b) for a, b in zip(self.on, self.off, strict=True)]
        mean = statistics.fmean(logs)
        if len(logs) < 2:
            return math.exp(mean), 0.0, math.inf
        half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
        return math.exp(mean), math.exp(mean - half), math.exp(mean + half)

    def median_ratio(self) -> tuple[float, float, float]:
        """(median ratio on/off over rounds, 95% CI low, high): the distribution-free interval of a median
        (order statistics of the rounds' ratios), which heavy tails (a stall that hits one block) do not widen
        the way they widen the mean's."""
        ratios = sorted(a / b for a, b in zip(self.on, self.off, strict=True))
        n = len(ratios)
        median = statistics.median(ratios)
        k = math.floor((n - 1.96 * math.sqrt(n)) / 2)  # normal approximation to the binomial(n, 1/2)
        if k < 1:
            return median, 0.0, math.inf
        return median, ratios[k - 1], ratios[n - k]

    def width(self, stat: str = "mean") -> float:
        _, lo, hi = self.median_ratio() if stat == "median" else self.ratio()
        return hi - lo

    def describe(self, unit: str) -> str:
        r, lo, hi = self.ratio()
        return (
            f"patched {statistics.median(self.on):10.1f} unpatched {statistics.median(self.off):10.1f} {unit} "
            f"(medians) ratio {r:.4f} [95% CI {lo:.4f}, {hi:.4f}] ({self.rounds} rounds)"
        )


def run_until(
    run: Callable[[], float],
    without: Callable[[], AbstractContextManager[object]],
    *,
    min_rounds: int,
    max_rounds: int,
    width: float,
    budget_s: float,
) -> Paired:
    """Alternate ``run()`` (patched) and ``run()`` inside ``without()`` (unpatched) until the ratio's 95%
    interval is narrower than ``width``, ``max_rounds`` are done, or ``budget_s`` seconds have passed
    (after ``min_rounds``). ``run`` returns a throughput."""
    result = Paired()
    start = time.perf_counter()
    for i in _count():
        if i % 2:
            result.on.append(run())
        with without():
            result.off.append(run())
        if not i % 2:
            result.on.append(run())
        n = i + 1
        if n >= max_rounds:
            break
        if n >= min_rounds and (result.width() < width or time.perf_counter() - start > budget_s):
            break
    return result


def _count() -> Iterator[int]:
    i = 0
    while True:
        yield i
        i += 1
