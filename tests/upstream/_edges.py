"""Graph bounds the tests of the offset-detach family hold a fixed cache to (test support, not a fix: the units
tie metadata with ``kvpatch.patches._lazy`` and never read these)."""

from __future__ import annotations

from typing import Any

from kvpatch.patches._lazy import EVERY, ClassValue


def max_edges(period: int) -> int:
    """The most edges a metadata array's pending graph reaches when it is tied once every ``period`` steps: 5 edges
    a step, 7 with offset-rebind stacked on the same method (measured), and some slack."""
    return 7 * period + 10


#: :func:`max_edges` for ties every ``_lazy.EVERY`` steps.
MAX_EDGES = max_edges(EVERY)


def growth_period(cls: Any) -> int | None:
    """The growth tie's period (the class's ``step``) where it serves ``cls``'s ``step`` now, else None."""
    return cls.step if isinstance(vars(cls).get("step"), ClassValue) else None
