"""``lazy-bounded``: a fixed drive, not a random one. Each batch cache decodes with nothing but its outputs evaluated
(a layer whose graph never reads the metadata, e.g. a NoPE layer), and then serves a batch whose rows come and go
(extend, one decode step, filter); the unevaluated graph behind every metadata array (the per-row vectors a cache
keeps besides its keys and values) must not grow between two checkpoints. Runs inside a bucket.
"""

from __future__ import annotations

from kvpatch.patches._lazy import CHECKPOINTS

from .machine import Caught, Violation
from .tape import Tape, header
from .targets import Target

#: Rows joining and leaving: checkpoints after this many cycles (a multiple of the decode ties' period apart).
CHURN = (20, 60)

_MEASURE = (
    "        grown[t + 1] = {k: edges(a) for k, a in vars(cache).items() if isinstance(a, mx.array) and a.ndim == 1}"
)


def _decode_lines(target: Target) -> list[str]:
    t = target
    if t.kind == "arrays":
        make = f"cache = {t.name}({t.call(t.arguments, left_padding=[1, 0])})"
        feed = [
            "    cache[0] = mx.random.normal((2, 8), key=mx.random.key(t))  # a recurrent layer's new state",
            "    if hasattr(cache, 'advance'):",
            "        cache.advance(1)",
            "    mx.eval(cache[0])  # only the state, as every layer but the one that builds the mask leaves it",
        ]
    else:
        make = f"cache = {t.name}({t.call(t.arguments, left_padding=[1, 0])})"
        feed = [
            "    out, _ = attend(cache, *data(t, 2, 3 if t == 0 else 1), masked=False)",
            "    mx.eval(out)  # only the outputs, as a layer whose graph never reads the offset (NoPE) leaves it",
        ]
    return [
        make,
        "grown = {}",
        f"for t in range({CHECKPOINTS[1]}):",
        *feed,
        f"    if t + 1 in {tuple(CHECKPOINTS)}:",
        _MEASURE,
    ]


def _churn_lines(target: Target) -> list[str]:
    t = target
    if t.kind == "arrays":
        new = f"{t.name}({t.call(t.arguments, left_padding=[0])})"
        start = [f"cache = {t.name}({t.call(t.arguments, left_padding=[0, 0])})", "cache[0] = mx.zeros((2, 8))"]
        join = [f"    other = {new}", "    other[0] = mx.ones((1, 8))"]
        step = [
            "    cache[0] = cache[0] * 0.5 + 1",
            "    if hasattr(cache, 'advance'):",
            "        cache.advance(1)",
            "    mx.eval(cache[0])",
        ]
    else:
        new = f"{t.name}({t.call(t.arguments, left_padding=[0])})"
        start = [f"cache = {t.name}({t.call(t.arguments, left_padding=[0, 0])})", "attend(cache, *data(0, 2, 3))"]
        join = [f"    other = {new}", "    attend(other, *data(1000 + t, 1, 3))"]
        step = ["    out, _ = attend(cache, *data(t + 1, 3, 1), masked=False)", "    mx.eval(out)"]
    return [
        *start,
        "grown = {}",
        f"for t in range({CHURN[1]}):  # a row joins, the batch decodes a token, the oldest row leaves",
        *join,
        "    cache.extend(other)",
        *step,
        "    cache.filter([1, 2])",
        f"    if t + 1 in {CHURN}:",
        _MEASURE,
    ]


def _check(points: tuple[int, int]) -> list[str]:
    a, b = points
    return [
        "print('pending graph edges of each metadata array, by step:', grown)",
        f"assert all(grown[{b}][k] <= grown[{a}][k] for k in grown[{a}]), 'grows without bound'",
    ]


def drive(target: Target) -> list[Caught]:
    """The violations of ``lazy-bounded`` for one batch target (decode, then churn where it has extend/filter)."""
    out: list[Caught] = []
    checkpoints = (CHECKPOINTS[0], CHECKPOINTS[1])
    drives: list[tuple[str, list[str], tuple[int, int]]] = [("decode", _decode_lines(target), checkpoints)]
    if "extend" in target.operations and "filter" in target.operations:
        drives.append(("extend/filter churn", _churn_lines(target), CHURN))
    for operation, lines, points in drives:
        tape = Tape(header(target))
        try:
            tape.run("\n".join(lines))
        except Exception:  # upstream raised during the drive: crashes are the state machines' to report
            continue
        grown: dict[int, dict[str, int]] = tape.value("grown")
        a, b = points
        growing = {k: (grown[a][k], grown[b].get(k, 0)) for k in grown[a] if grown[b].get(k, 0) > grown[a][k]}
        if growing:
            detail = ", ".join(f"{k}: {x} -> {y} edges" for k, (x, y) in growing.items())
            violation = Violation(
                "lazy-bounded",
                f"metadata graphs grow between steps {a} and {b} of {operation}: {detail}",
                operation,
                (),
                target.id,
                check=_check(points),
            )
            out.append(Caught(violation, list(tape.head), list(tape.lines)))
    return out


def lazy_targets(targets: list[Target]) -> list[Target]:
    return [t for t in targets if t.kind in ("batch", "arrays")]
