"""The cache-level hunt: Hypothesis state machines that drive one cache class through random operation sequences,
check the invariants (:mod:`kvpatch.maint.hunt.invariants`) after every operation, and shrink a failure to a
minimal sequence. Every operation is a line of a :class:`~kvpatch.maint.hunt.tape.Tape`, so the shrunk sequence is
the reproduction. Runs inside a bucket (imports upstream and hypothesis).

A violation is identified by its *signature*: the class, the invariant, the operation it followed and the situation
that operation met (the cache never updated, padding still to come, right padding pending, a row without tokens, a
window wrapped...). Once found, a signature is *known*: a later sequence that runs into it again is discarded, so one
budget finds several distinct bugs of one class instead of the easiest one many times.
"""

from __future__ import annotations

import itertools
import re
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hypothesis import reject
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvpatch.patches import _numbers

from .tape import PROBE, Tape, header
from .targets import Target


@dataclass
class Violation(Exception):
    """An invariant that no longer holds after an operation."""

    invariant: str
    detail: str
    operation: str
    situation: tuple[str, ...]
    target: str
    error: str | None = None  # the exception's type, for ``no-crash``
    check: list[str] = field(default_factory=list)  # source lines that show it, after the tape
    before: list[str] = field(default_factory=list)  # source lines to run before the tape's last line

    def __str__(self) -> str:
        return f"{self.target}: {self.invariant} after {self.operation}: {self.detail}"

    @property
    def signature(self) -> tuple[str, ...]:
        """An update's violations are the update's own (a structural operation's effects are probed right after
        it), so the situation tells them apart only for the structural operations."""
        situation = () if self.operation in UPDATES else tuple(sorted(self.situation))
        operation = "update" if self.operation == "decode" else self.operation
        return (self.target, self.invariant, operation, self.error or "", self.message, *situation)

    @property
    def message(self) -> str:
        """A crash's message without its numbers (two crashes of one operation are two bugs when they say different
        things: a shape mismatch is not a type error in a mask)."""
        if self.invariant != "no-crash":
            return ""
        return re.sub(r"[\d.]+", "#", self.detail.split(":", 1)[-1])[:60].strip()


#: The operations that feed tokens.
UPDATES = frozenset({"update", "decode", "prepare+update"})
#: Invariants whose violation leaves every row's keys, values and offsets as they should be (a handle a model kept,
#: a method's answer, a row copied out): once known, a sequence that meets one again goes on instead of being
#: discarded, so that a bug met on every step (an in-place offset) does not hide the ones behind it.
HARMLESS = frozenset({"kept-handle", "nbytes-reads", "trimmable-agrees", "extract-agrees"})


@dataclass
class Caught:
    """The violation of the last failing run, and the tape that led to it (the shrunk one once Hypothesis is done)."""

    violation: Violation
    head: list[str]
    lines: list[str]
    #: Upstream modules whose patches may bear on it, where the reproduction's imports do not say (model level).
    modules: list[str] = field(default_factory=list)


@dataclass
class Row:
    tokens: int = 0  # real tokens fed
    lead: int = 0  # left padding its next update still brings


def bound(dtype: Any, pairs: list[tuple[Any, Any]]) -> float:
    """What a reproduction asserts a difference stays within: :data:`~kvpatch.patches._numbers.CLEAR` times the rounding
    of ``dtype`` at the magnitude of the references (the hunt itself judges with :func:`_numbers.judge`'s rule)."""
    import mlx.core as mx

    scale = max((float(mx.abs(w.astype(mx.float32)).max().item()) for _, w in pairs), default=1.0)
    return _numbers.CLEAR * _numbers.rounding(dtype, scale)


class Machine(RuleBasedStateMachine):
    """What the machines share: the target, the known signatures, the violations caught, the deadline, the tape."""

    target: ClassVar[Target]
    known: ClassVar[set[tuple[str, ...]]]
    caught: ClassVar[list[Caught]]
    deadline: ClassVar[float] = float("inf")  # time.monotonic() past which every rule rejects
    tape: Tape
    seeds: Iterator[int]

    def fail(self, invariant: str, detail: str, operation: str, situation: tuple[str, ...], **more: Any) -> None:
        violation = Violation(invariant, detail, operation, situation, self.target.id, **more)
        if violation.signature in self.known:
            if invariant in HARMLESS:
                return  # known, and the cache's rows are intact: go on, deeper sequences find other bugs
            reject()
        self.caught.append(Caught(violation, list(self.tape.head), list(self.tape.lines)))
        raise violation

    def run(self, operation: str, situation: tuple[str, ...], *lines: str) -> None:
        """Run upstream's lines; an exception there is a ``no-crash`` violation."""
        for line in lines:
            try:
                self.tape.run(line)
            except Exception as exc:
                text = traceback.format_exception_only(type(exc), exc)[-1].strip()
                self.fail("no-crash", text, operation, situation, error=type(exc).__name__)

    def seed(self) -> int:
        return next(self.seeds)


class CacheMachine(Machine):
    """Drives one KV cache class (a batch class against its single-row class, or a single-row class against
    itself fed one token at a time)."""

    def __init__(self) -> None:
        super().__init__()
        self.tape = Tape(header(self.target, extra_imports=self._imports()))
        self.rows: list[Row] = []
        self.pending: list[int] | None = None
        self.seeds = itertools.count(1)
        self.dims = (32, 32)
        self.dtype = "mx.float32"
        self.started = False
        self.saved: Any = None

    # -- plumbing -------------------------------------------------------------------------------------------------

    def _imports(self) -> tuple[str, ...]:
        """save/load of a prompt cache (a single-row cache: what ``save_prompt_cache`` writes), where the class's
        module has them."""
        import importlib

        if self.target.kind == "single" and hasattr(importlib.import_module(self.target.module), "save_prompt_cache"):
            return (f"from {self.target.module} import load_prompt_cache, save_prompt_cache",)
        return ()

    @property
    def batch(self) -> bool:
        return self.target.kind == "batch"

    @property
    def primed(self) -> bool:
        """The cache holds keys (an update reached it, or a merge or extend brought some)."""
        cache = self.tape.ns.get("cache")
        return cache is not None and getattr(cache, "keys", None) is not None

    def situation(self, *extra: str) -> tuple[str, ...]:
        if time.monotonic() > self.deadline:
            reject()  # out of time: Hypothesis ends the round (and any shrinking) quickly
        flags = list(extra)
        if not self.primed:
            flags.append("unprimed")
        if any(r.lead for r in self.rows):
            flags.append("padding-to-come")
        if self.pending is not None:
            flags.append("right-padding-pending")
        if any(r.tokens == 0 for r in self.rows):
            flags.append("row-without-tokens")
        window = self.target.window
        if window is not None and any(r.tokens > window for r in self.rows):
            flags.append("window-wrapped")
        return tuple(flags)

    def data_args(self) -> str:
        return f"dims={self.dims}, dtype={self.dtype}"

    # -- checks ---------------------------------------------------------------------------------------------------

    def check_pairs(self, operation: str, situation: tuple[str, ...], expression: str = "pairs") -> None:
        pairs = self.tape.value(expression)
        dtype = self.tape.value(self.dtype)
        for got, _ in pairs:
            if got.dtype != dtype:
                self.fail(
                    "dtype-kept",
                    f"attention through the cache comes back {got.dtype} for {dtype} input",
                    operation,
                    situation,
                    check=[
                        f"print('dtype in:', {self.dtype}, 'attention out:', [a.dtype for a, _ in {expression}])",
                        f"assert all(a.dtype == {self.dtype} for a, _ in {expression})",
                    ],
                )
        found = _numbers.worst(_numbers.difference(got, want, dtype) for got, want in pairs)
        if found is not None and found.clear:
            self.fail(
                "rows-agree",
                f"a row's attention in the batch differs from the same row alone by {found}",
                operation,
                situation,
                check=[
                    f"err = max(mx.abs(a - b).max().item() for a, b in {expression})",
                    "print('largest difference between a row in the batch and the same row alone:', err)",
                    f"assert err <= {bound(dtype, pairs):.2g}, err  # {_numbers.CLEAR}x the dtype's rounding here",
                ],
            )

    def check_new_keys(self, operation: str, situation: tuple[str, ...]) -> None:
        """Every real key just given is among the keys handed back (dense caches: their keys are one array)."""
        import mlx.core as mx

        keys, new = self.tape.value("keys"), self.tape.value("new")
        if not isinstance(keys, mx.array) or keys.ndim != 4:
            return
        if self.pending is not None:
            return  # a right-padded row's newest key is padding
        for i in range(min(keys.shape[0], new.shape[0])):
            last = new[i, :, -1]  # the newest key of row i
            hits = mx.all(keys[i] == last[:, None, :], axis=(0, 2))
            if not bool(mx.any(hits).item()):
                self.fail(
                    "new-keys-held",
                    f"row {i}: the newest key is not among the {keys.shape[2]} keys update_and_fetch handed back",
                    operation,
                    situation,
                    check=[
                        "held = [bool(mx.any(mx.all(keys[i] == new[i, :, -1][:, None, :], axis=(0, 2)))) "
                        "for i in range(new.shape[0])]",
                        "print('each row\\'s newest key among the keys handed back:', held)",
                        "assert all(held)",
                    ],
                )

    def offsets(self) -> tuple[str, list[int]] | None:
        """The expression and value of the cache's per-row offsets, or None when they are not a plain offset."""
        offset = self.tape.value("cache.offset") if hasattr(self.tape.value("cache"), "offset") else None
        if isinstance(offset, int):
            return "[cache.offset]", [offset]
        import mlx.core as mx

        if isinstance(offset, mx.array) and offset.ndim == 1:
            return "cache.offset.tolist()", offset.tolist()
        return None

    def check_offsets(self, operation: str, situation: tuple[str, ...]) -> None:
        if self.pending is not None:
            return
        got = self.offsets()
        if got is None:
            return
        expression, values = got
        settled = [i for i, r in enumerate(self.rows) if r.lead == 0]
        want = [self.tape.value(f"rows[{i}].offset") for i in settled]
        have = [values[i] for i in settled] if len(values) == len(self.rows) else values
        if have != want or len(values) != len(self.rows):
            pick = f"[{expression}[i] for i in {settled}]" if len(settled) != len(self.rows) else expression
            self.fail(
                "offsets-agree",
                f"offsets {values} (rows {settled}), each row alone {want}",
                operation,
                situation,
                check=[
                    f"print('batch offsets:', {expression}, 'each row alone:', [r.offset for r in rows])",
                    f"assert {pick} == [rows[i].offset for i in {settled}]",
                ],
            )

    def check_handle(self, operation: str, situation: tuple[str, ...], kept: Any, copy: Any) -> None:
        if kept is None or _numbers.exact(kept, copy):
            return
        self.fail(
            "kept-handle",
            f"the offset array read before update_and_fetch changed from {copy.tolist()} to {kept.tolist()}",
            operation,
            situation,
            before=["kept = cache.offset", "before = mx.array(kept)"],
            check=[
                "print('offset read before the step:', before.tolist(), 'the same array after it:', kept.tolist())",
                "assert mx.array_equal(kept, before)",
            ],
        )

    def before(self) -> None:
        """Keep copies of the cache and the rows as a structural operation finds them, so that its probe can tell
        a state this operation broke from one it was handed."""
        import copy

        try:
            saved = copy.deepcopy((self.tape.ns.get("cache"), self.tape.ns.get("rows")))
        except Exception:
            saved = None
        self.saved = (saved, [Row(r.tokens, r.lead) for r in self.rows], self.pending)

    def after(self, operation: str, situation: tuple[str, ...]) -> None:
        self.check_offsets(operation, situation)
        if operation not in UPDATES:
            self.probe(operation, situation)
        self.saved = None

    def probe(self, operation: str, situation: tuple[str, ...]) -> None:
        """One more step on copies of the cache and the rows (finalizing pending right padding first, feeding
        padding still to come), so that what ``operation`` did shows as its own violation."""
        if not self.rows or self.tape.ns.get("cache") is None:
            return
        import copy

        try:
            copy.deepcopy((self.tape.value("cache"), self.tape.value("rows")))
        except Exception:
            return  # a cache that cannot be copied is only checked by the next real step
        lead = [r.lead for r in self.rows]
        n = max(lead) + 1
        lines = [PROBE]
        if self.pending is not None:
            lines.append("probe.finalize()")
        args = f"probe, probe_rows, {self.seed()}, {n}" + (f", left={lead}" if any(lead) else "")
        lines.append(f"pairs, keys, new = step({args}, {self.data_args()})")
        mark = len(self.tape.lines)
        try:
            self.run(operation, situation, *lines)
            self.check_pairs(operation, situation)
        except Violation:
            if self.broken_before():
                del self.tape.lines[mark:]
                self.caught.pop()
                return  # the state was broken before this operation: the next step reports it as its own
            raise
        del self.tape.lines[mark:]  # it held: the reproduction of a later violation does not need it

    def broken_before(self) -> bool:
        """Whether the probe fails on the state the last structural operation was handed as well."""
        import copy

        saved, rows, pending = getattr(self, "saved", (None, [], None))
        if saved is None or saved[0] is None or not rows:
            return False
        lead = [r.lead for r in rows]
        self.tape.ns["probe"], self.tape.ns["probe_rows"] = copy.deepcopy(saved)
        lines = ["probe.finalize()"] if pending is not None else []
        args = f"probe, probe_rows, {self.seed()}, {max(lead) + 1}" + (f", left={lead}" if any(lead) else "")
        lines.append(f"pairs, keys, new = step({args}, {self.data_args()})")
        try:
            for line in lines:
                exec(compile(line, "<hunt>", "exec"), self.tape.ns)
            pairs = self.tape.value("pairs")
            dtype = self.tape.value(self.dtype)
            if any(got.dtype != dtype for got, _ in pairs):
                return True
            found = _numbers.worst(_numbers.difference(g, w, dtype) for g, w in pairs)
            return found is not None and found.clear
        except Exception:
            return True

    # -- operations -----------------------------------------------------------------------------------------------

    @initialize(
        left=st.lists(st.integers(0, 3), min_size=1, max_size=3),
        dtype=st.sampled_from(["mx.float32", "mx.bfloat16"]),
        dims=st.sampled_from([(32, 32), (64, 32)]),
    )
    def start(self, left: list[int], dtype: str, dims: tuple[int, int]) -> None:
        t = self.target
        self.dtype, self.dims = dtype, dims
        if not self.batch:
            left = [0]
        self.rows = [Row(0, p) for p in left]
        single = f"{t.single}({t.call(t.single_arguments)})"
        lines = [f"rows = [{single} for _ in range({len(left)})]"]
        if self.batch:
            lines.insert(0, f"cache = {t.name}({t.call(t.arguments, left_padding=left)})")
        else:
            lines.insert(0, f"cache = {t.name}({t.call(t.arguments)})")
        self.run("start", ("unprimed",), *lines)
        self.started = True

    def _step(self, n: int, right: list[int] | None, operation: str) -> None:
        situation = self.situation()
        lead = [min(r.lead, n) for r in self.rows]
        right = right or [0] * len(self.rows)
        args = [f"cache, rows, {self.seed()}, {n}"]
        if any(lead):
            args.append(f"left={lead}")
        if any(right):
            args.append(f"right={right}")
        args.append(self.data_args())
        line = f"pairs, keys, new = step({', '.join(args)})"
        lines = []
        if any(right):
            keywords = {"lengths": [n - r - p for r, p in zip(right, lead, strict=True)], "right_padding": right}
            call = ", ".join(f"{k}={keywords[k]}" for k in self.target.prepare_keywords)
            lines.append(f"cache.prepare({call})")
        self.run(operation, situation, *lines)
        cache = self.tape.value("cache")
        kept = getattr(cache, "offset", None)
        import mlx.core as mx

        copy = mx.array(kept) if isinstance(kept, mx.array) else None
        self.run(operation, situation, line)
        for row, p, r in zip(self.rows, lead, right, strict=True):
            row.tokens += n - p - r
            row.lead -= p
        if any(right):
            self.pending = right
        self.check_handle(operation, situation, kept if copy is not None else None, copy)
        self.check_pairs(operation, situation)
        self.check_new_keys(operation, situation)
        self.after(operation, situation)

    @precondition(lambda self: self.started and self.pending is None and bool(self.rows))
    @rule(n=st.integers(1, 4))
    def update(self, n: int) -> None:
        self._step(n, None, "update" if n > 1 else "decode")

    @precondition(
        lambda self: (
            self.started
            and self.batch
            and self.pending is None
            and "prepare" in self.target.operations
            and not any(r.lead for r in self.rows)
        )
    )
    @rule(n=st.integers(2, 4), data=st.data())
    def update_right_padded(self, n: int, data: st.DataObject) -> None:
        """A right-padded prefill chunk, as BatchGenerator processes prompts of different lengths (``prepare``, the
        update, later ``finalize``): every row brings at least one token, and padding still to come from the rows'
        construction is never mixed in."""
        rows = len(self.rows)
        right = data.draw(st.lists(st.integers(0, n - 1), min_size=rows, max_size=rows))
        if not any(right):
            right[0] = n - 1
        self._step(n, right, "prepare+update")

    @precondition(lambda self: self.started and self.pending is not None)
    @rule()
    def finalize(self) -> None:
        situation = self.situation()
        self.run("finalize", situation, "cache.finalize()")
        self.pending = None
        self.after("finalize", situation)

    @precondition(
        lambda self: self.started and self.batch and len(self.rows) > 1 and "filter" in self.target.operations
    )
    @rule(data=st.data())
    def filter(self, data: st.DataObject) -> None:
        keep = sorted(data.draw(st.sets(st.integers(0, len(self.rows) - 1), min_size=1, max_size=len(self.rows) - 1)))
        situation = self.situation()
        self.before()
        self.run("filter", situation, f"cache.filter({keep})", f"rows = [rows[i] for i in {keep}]")
        self.rows = [self.rows[i] for i in keep]
        if self.pending is not None:
            self.pending = [self.pending[i] for i in keep]
        self.after("filter", situation)

    @precondition(
        lambda self: self.started and self.batch and self.pending is None and "extend" in self.target.operations
    )
    @rule(left=st.lists(st.integers(0, 3), min_size=1, max_size=2), n=st.integers(0, 4))
    def extend(self, left: list[int], n: int) -> None:
        t = self.target
        n = max(n, max(left) + 1) if n else 0
        other = [Row(0, p) for p in left]
        extra = ("other-empty",) if n == 0 else ()
        situation = self.situation(*extra)
        self.before()
        single = f"{t.single}({t.call(t.single_arguments)})"
        lines = [
            f"other = {t.name}({t.call(t.arguments, left_padding=left)})",
            f"others = [{single} for _ in range({len(left)})]",
        ]
        if n:
            lines.append(f"pairs, keys, new = step(other, others, {self.seed()}, {n}, left={left}, {self.data_args()})")
        self.run("extend", situation, *lines)
        if n:
            for row in other:
                row.tokens, row.lead = n - row.lead, 0
            self.check_pairs("extend", situation)
        self.run("extend", situation, "cache.extend(other)", "rows += others")
        self.rows += other
        self.after("extend", situation)

    @precondition(lambda self: self.started and self.batch and self.pending is None and hasattr(self._cls(), "merge"))
    @rule(empties=st.integers(0, 2))
    def merge(self, empties: int) -> None:
        t = self.target
        situation = self.situation(*(("with-empty-rows",) if empties else ()))
        self.before()
        single = f"{t.single}({t.call(t.single_arguments)})"
        sources = "[copy.deepcopy(r) for r in rows]" + (f" + [{single} for _ in range({empties})]" if empties else "")
        lines = [f"cache = {t.name}.merge({sources})"]
        if empties:
            lines.append(f"rows += [{single} for _ in range({empties})]")
        self.run("merge", situation, *lines)
        self.rows = [Row(r.tokens, 0) for r in self.rows] + [Row(0, 0) for _ in range(empties)]
        self.after("merge", situation)

    def fresh(self) -> str:
        """Source of a fresh cache of the target class with as many rows as the cache under test."""
        t = self.target
        if self.batch:
            return f"{t.name}({t.call(t.arguments, left_padding=[0] * len(self.rows))})"
        return f"{t.name}({t.call(t.arguments)})"

    def _cls(self) -> Any:
        return self.tape.value(self.target.name)

    @precondition(lambda self: self.started and self.batch and self.primed and "extract" in self.target.operations)
    @rule(data=st.data())
    def extract(self, data: st.DataObject) -> None:
        """extract(i) of a row that holds its prompt (a row whose padding is still to come has not started)."""
        ready = [i for i, r in enumerate(self.rows) if not r.lead]
        if not ready:
            return
        i = data.draw(st.sampled_from(ready))
        situation = self.situation()
        self.before()
        self.run("extract", situation, f"single = cache.extract({i})")
        want = self.tape.value(f"rows[{i}].offset")
        got = getattr(self.tape.value("single"), "offset", None)
        if not _numbers.exact(got, want):
            self.fail(
                "extract-agrees",
                f"extract({i}).offset is {got}, row {i} alone has {want}",
                "extract",
                situation,
                check=[
                    f"print('extracted offset:', single.offset, 'row alone:', rows[{i}].offset)",
                    f"assert single.offset == rows[{i}].offset",
                ],
            )
        seed = self.seed()
        probe = (
            f"pairs = [(alone(single, *data({seed}, 1, 1, {self.data_args()})), "
            f"alone(copy.deepcopy(rows[{i}]), *data({seed}, 1, 1, {self.data_args()})))]"
        )
        self.run("extract", situation, probe)
        self.check_pairs("extract", situation)
        self.after("extract", situation)

    @precondition(
        lambda self: (
            self.started
            and self.pending is None
            and self.rows
            and not any(r.lead for r in self.rows)
            and hasattr(self._cls(), "trim")
            and hasattr(self._cls(), "is_trimmable")
        )
    )
    @rule(n=st.integers(1, 3))
    def trim(self, n: int) -> None:
        """Trim n tokens (speculative decoding's rollback): rows that still expect their prompt's padding hold no
        tokens to trim, so no row may have padding to come."""
        situation = self.situation()
        self.before()
        self.run("trim", situation, "trimmable = (cache.is_trimmable(), [r.is_trimmable() for r in rows])")
        batch, rows = self.tape.value("trimmable")
        if self.batch and bool(batch) != all(rows):
            self.fail(
                "trimmable-agrees",
                f"the batch says is_trimmable()={batch}, its rows alone {rows}",
                "is_trimmable",
                situation,
                check=[
                    "print('batch is_trimmable:', trimmable[0], 'rows alone:', trimmable[1])",
                    "assert trimmable[0] == all(trimmable[1])",
                ],
            )
        if not batch or not all(rows):
            return
        self.run("trim", situation, f"cache.trim({n})", f"for r in rows: r.trim({n})")
        for row in self.rows:
            row.tokens -= min(n, row.tokens)
        self.after("trim", situation)

    @precondition(lambda self: self.started and self.pending is None and self.primed and hasattr(self._cls(), "state"))
    @rule()
    def state_roundtrip(self) -> None:
        situation = self.situation()
        self.before()
        fresh = self.fresh()
        self.run("state round trip", situation, f"cache = restore(cache, {fresh})")
        self.after("state round trip", situation)

    @precondition(
        lambda self: (
            self.started
            and self.pending is None
            and self.primed
            and hasattr(self._cls(), "prefix_cache_snapshot")
            and hasattr(self._cls(), "prefix_cache_restore")
        )
    )
    @rule()
    def prefix_snapshot(self) -> None:
        """A prefix-cache snapshot restored into a fresh cache of the class (the round trip its protocol promises)."""
        situation = self.situation()
        self.before()
        fresh = self.fresh()
        self.run("prefix snapshot", situation, f"cache = snapshot(cache, {fresh})")
        self.after("prefix snapshot", situation)

    @precondition(
        lambda self: (
            self.started
            and self.pending is None
            and "load_prompt_cache" in self.tape.ns
            and all(r.tokens for r in self.rows)
        )
    )
    @rule()
    def save_load(self) -> None:
        """A prompt cache (it holds a prompt) written with save_prompt_cache and read back with load_prompt_cache."""
        situation = self.situation()
        self.before()
        path = tempfile.mkdtemp(prefix="kvpatch-hunt-")
        self.run(
            "save/load",
            situation,
            f"path = {path!r} + '/cache.safetensors'  # any writable directory",
            "save_prompt_cache(path, [cache])",
            "cache = load_prompt_cache(path)[0]",
        )
        self.after("save/load", situation)

    @precondition(lambda self: self.started)
    @rule()
    def nbytes(self) -> None:
        situation = self.situation()
        if not hasattr(type(self.tape.value("cache")), "nbytes"):
            return
        try:
            self.tape.value("cache.nbytes")
        except NotImplementedError:
            return  # upstream's own word: this class does not offer nbytes
        except Exception:
            pass  # run() below reports it
        self.run("nbytes", situation, "size = cache.nbytes")
        size = self.tape.value("size")
        if not isinstance(size, int) or size < 0:
            self.fail(
                "nbytes-reads",
                f"nbytes is {size!r}",
                "nbytes",
                situation,
                check=["print('nbytes:', size)", "assert isinstance(size, int) and size >= 0"],
            )

    @precondition(
        lambda self: self.started and self.primed and self.pending is None and all(r.tokens for r in self.rows)
    )
    @rule()
    def dequantize(self) -> None:
        cache = self.tape.value("cache")
        if not callable(getattr(cache, "dequantize", None)) or getattr(cache, "keys", None) is None:
            return
        situation = self.situation()
        self.run("dequantize", situation, "dk, dv = cache.dequantize()")
        dk, dv = self.tape.value("dk"), self.tape.value("dv")
        dtype = self.tape.value(self.dtype)
        if dk.dtype != dtype or dv.dtype != dtype:
            self.fail(
                "dtype-kept",
                f"dequantize() returns {dk.dtype}/{dv.dtype} for {dtype} keys/values",
                "dequantize",
                situation,
                check=[
                    f"print('fed:', {self.dtype}, 'dequantized:', dk.dtype, dv.dtype)",
                    f"assert dk.dtype == dv.dtype == {self.dtype}",
                ],
            )


class ArraysMachine(Machine):
    """Drives a batch ArraysCache (recurrent states) against one ArraysCache per row fed alone."""

    def __init__(self) -> None:
        super().__init__()
        self.tape = Tape(header(self.target))
        self.rows: list[Row] = []
        self.pending: list[int] | None = None
        self.seeds = itertools.count(1)
        self.started = False
        self.primed = False

    def situation(self, *extra: str) -> tuple[str, ...]:
        if time.monotonic() > self.deadline:
            reject()  # out of time: Hypothesis ends the round (and any shrinking) quickly
        flags = list(extra)
        if not self.primed:
            flags.append("unprimed")
        if any(r.lead for r in self.rows):
            flags.append("padding-to-come")
        if self.pending is not None:
            flags.append("right-padding-pending")
        return tuple(flags)

    @initialize(left=st.lists(st.integers(0, 3), min_size=1, max_size=3))
    def start(self, left: list[int]) -> None:
        t = self.target
        self.rows = [Row(0, p) for p in left]
        lines = [
            f"cache = {t.name}({t.call(t.arguments)})",
            f"cache.left_padding = mx.array({left})  # as the batch generator sets it",
            f"rows = [{t.name}({t.call(t.arguments)}) for _ in range({len(left)})]",
        ]
        self.run("start", ("unprimed",), *lines)
        self.started = True

    def _step(self, n: int, right: list[int] | None, operation: str) -> None:
        situation = self.situation()
        lead = [min(r.lead, n) for r in self.rows]
        right = right or [0] * len(self.rows)
        lines = []
        if any(right):
            keywords = {"lengths": [n - r for r in right], "right_padding": right}
            call = ", ".join(f"{k}={keywords[k]}" for k in self.target.prepare_keywords)
            lines.append(f"cache.prepare({call})")
        lines.append(f"state, x = recur(cache, {self.seed()}, {n}, {len(self.rows)})")
        real = [i for i, (p, r) in enumerate(zip(lead, right, strict=True)) if n - r > p]
        lines.append(
            f"want = {{i: recur_alone(rows[i], x[i : i + 1, a : {n} - b]) for i, a, b in "
            f"zip({real}, {[lead[i] for i in real]}, {[right[i] for i in real]})}}"
        )
        self.run(operation, situation, *lines)
        for row, p, r in zip(self.rows, lead, right, strict=True):
            row.tokens += n - p - r
            row.lead -= p
        self.primed = True
        if any(right):
            self.pending = right
        state, want = self.tape.value("state"), self.tape.value("want")
        pairs = [(state[i : i + 1], w) for i, w in want.items()]
        found = _numbers.worst(_numbers.difference(got, w) for got, w in pairs)
        if found is not None and found.clear:
            self.fail(
                "states-agree",
                f"a row's state in the batch differs from the same row alone by {found}",
                operation,
                situation,
                check=[
                    "err = max(mx.abs(state[i : i + 1] - w).max().item() for i, w in want.items())",
                    "print('largest difference between a row\\'s state in the batch and alone:', err)",
                    f"assert err <= {bound(state.dtype, pairs):.2g}, err  # {_numbers.CLEAR}x float32 rounding here",
                ],
            )

    @precondition(lambda self: self.started and self.pending is None)
    @rule(n=st.integers(1, 4))
    def update(self, n: int) -> None:
        self._step(n, None, "update" if n > 1 else "decode")

    @precondition(
        lambda self: (
            self.started
            and self.pending is None
            and "prepare" in self.target.operations
            and not any(r.lead for r in self.rows)
        )
    )
    @rule(n=st.integers(2, 4), data=st.data())
    def update_right_padded(self, n: int, data: st.DataObject) -> None:
        rows = len(self.rows)
        right = data.draw(st.lists(st.integers(0, n - 1), min_size=rows, max_size=rows))
        if not any(right):
            right[0] = n - 1
        self._step(n, right, "prepare+update")

    @precondition(lambda self: self.started and self.pending is not None and "finalize" in self.target.operations)
    @rule()
    def finalize(self) -> None:
        self.run("finalize", self.situation(), "cache.finalize()")
        self.pending = None

    @precondition(
        lambda self: self.started and self.primed and len(self.rows) > 1 and "filter" in self.target.operations
    )
    @rule(data=st.data())
    def filter(self, data: st.DataObject) -> None:
        """Rows leave once the batch has states (a generator filters and extends batches after their prompt step)."""
        keep = sorted(data.draw(st.sets(st.integers(0, len(self.rows) - 1), min_size=1, max_size=len(self.rows) - 1)))
        self.run("filter", self.situation(), f"cache.filter({keep})", f"rows = [rows[i] for i in {keep}]")
        self.rows = [self.rows[i] for i in keep]
        if self.pending is not None:
            self.pending = [self.pending[i] for i in keep]

    @precondition(
        lambda self: self.started and self.primed and self.pending is None and "extend" in self.target.operations
    )
    @rule(left=st.lists(st.integers(0, 3), min_size=1, max_size=2), n=st.integers(1, 4))
    def extend(self, left: list[int], n: int) -> None:
        t = self.target
        n = max(n, max(left) + 1)
        situation = self.situation()
        lines = [
            f"other = {t.name}({t.call(t.arguments)})",
            f"other.left_padding = mx.array({left})",
            f"others = [{t.name}({t.call(t.arguments)}) for _ in range({len(left)})]",
        ]
        if n:
            lines += [
                f"state, x = recur(other, {self.seed()}, {n}, {len(left)})",
                f"want = {{i: recur_alone(row, x[i : i + 1, p:]) for i, (row, p) in enumerate(zip(others, {left}))}}",
            ]
        lines += ["cache.extend(other)", "rows += others"]
        self.run("extend", situation, *lines)
        self.rows += [Row(n - p, 0) if n else Row(0, p) for p in left]


def static_checks(targets: list[Target]) -> list[Caught]:
    """``has-operations``: each batch class against its package's BatchKVCache, one finding per missing operation
    (no sequence needed)."""
    from .targets import BATCH_OPERATIONS, MODULES

    out: list[Caught] = []
    for t in targets:
        if t.kind != "batch" or t.name == "BatchKVCache":
            continue
        reference = next((m for m in MODULES[t.distribution] if m.endswith(".cache")), None)
        head = ["import mlx.core as mx", f"from {reference} import BatchKVCache", f"from {t.module} import {t.name}"]
        for operation in BATCH_OPERATIONS:
            tape = Tape(head)
            tape.run(f"has = hasattr(BatchKVCache, {operation!r}), hasattr({t.name}, {operation!r})")
            reference_has, has = tape.value("has")
            if reference_has and not has:
                violation = Violation(
                    "has-operations",
                    f"{t.name} has no {operation}() (BatchKVCache has)",
                    operation,
                    (),
                    t.id,
                    check=[f"print('BatchKVCache, {t.name} have {operation}():', has)", "assert has[1] == has[0]"],
                )
                out.append(Caught(violation, head, list(tape.lines)))
    return out
