"""Running the cache-level state machines within a time budget: each target gets its share, found signatures become
known so that the next rounds look for other bugs, and every finding keeps its shrunk tape. Runs inside a bucket.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .machine import ArraysMachine, CacheMachine, Caught, Violation
from .targets import Target

#: Examples per round and operations per example: small rounds, so that a budget is spent evenly and a finding
#: ends its round early.
EXAMPLES = 40
STEPS = 12


@dataclass
class Outcome:
    target: Target
    caught: list[Caught]
    rounds: int
    seconds: float
    notes: list[str]


def _test(factory: type, settings: Any, seed: int) -> Any:
    from hypothesis import seed as use_seed
    from hypothesis.stateful import get_state_machine_test

    test = get_state_machine_test(factory, settings=settings, _flaky_state={"selecting_rule": False})
    return use_seed(seed)(test)


def hunt_target(target: Target, seconds: float, *, seed: int = 0, known: set[tuple[str, ...]] | None = None) -> Outcome:
    """Run ``target``'s machine for about ``seconds``: rounds of :data:`EXAMPLES` examples, each new violation
    shrunk, recorded and then known."""
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.errors import Flaky, FlakyStrategyDefinition, Unsatisfiable

    base = ArraysMachine if target.kind == "arrays" else CacheMachine
    known = set() if known is None else known
    caught: list[Caught] = []
    # Shrinking a late finding may run past the share by half of it at most.
    deadline = time.monotonic() + seconds * 3 / 2
    members = {"target": target, "known": known, "caught": [], "deadline": deadline}
    factory: Any = type(f"Hunt{target.name}", (base,), members)
    config = settings(
        max_examples=EXAMPLES,
        stateful_step_count=STEPS,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        report_multiple_bugs=False,
        print_blob=False,
    )
    notes: list[str] = []
    started = time.monotonic()
    rounds = 0
    while time.monotonic() - started < seconds:
        factory.caught.clear()
        try:
            _test(factory, config, seed * 1000 + rounds)()
        except Violation as violation:
            last = factory.caught[-1]
            if last.violation.signature != violation.signature:  # pragma: no cover - Hypothesis replays the last
                notes.append(f"shrunk tape lost for {violation}")
            else:
                caught.append(last)
            known.add(violation.signature)
        except (Unsatisfiable, Flaky, FlakyStrategyDefinition) as exc:
            if time.monotonic() > deadline:
                break  # the deadline's rejections made the round look flaky: it is over
            notes.append(f"round {rounds}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        rounds += 1
    return Outcome(target, caught, rounds, time.monotonic() - started, notes)


def smoke(target: Target) -> str | None:
    """Why ``target`` does not take part in the protocol the hunt drives (None when it does): one row, one token,
    no padding, as every model step does. Such a class is listed as not hunted, never reported as a bug."""
    from .tape import Tape, header

    t = target
    tape = Tape(header(t))
    if t.kind == "arrays":
        lines = [f"cache = {t.name}({t.call(t.arguments)})", "state, x = recur(cache, 0, 1, 1)"]
    elif t.kind == "batch":
        lines = [
            f"cache = {t.name}({t.call(t.arguments, left_padding=[0])})",
            f"rows = [{t.single}({t.call(t.single_arguments)})]",
            "pairs, keys, new = step(cache, rows, 0, 1)",
        ]
    else:
        lines = [f"cache = {t.name}({t.call(t.arguments)})", "out = alone(cache, *data(0, 1, 1))"]
    try:
        for line in lines:
            tape.run(line)
    except Exception as exc:
        return f"does not take one row's token as the models' caches do ({type(exc).__name__}: {exc})"
    return None
