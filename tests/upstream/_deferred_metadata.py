"""Checks shared by the tests of arrays-advance-detach (mlx-lm's ArraysCache) and vlm-arrays-advance-detach
(mlx-vlm's own, 0.6.4-0.6.15): both install ``_arrays``' deferred metadata on their class. Each takes the
class and the patch id and runs only where that patch is installed."""

from __future__ import annotations

import copy
import warnings
from typing import Any

from _edges import MAX_EDGES

import kvpatch
from kvpatch.patches._lazy import graph_edges
from kvpatch.testing import without


def advance(cache: Any, steps: int, n: int = 1) -> None:
    """``steps`` decode steps of a recurrent layer: read the state, store a new one, advance, evaluate the state."""
    import mlx.core as mx

    for _ in range(steps):
        cache[0] = cache[0] * 0.5 + 1
        cache.advance(n)
        mx.eval(cache[0])


def new_cache(cls: type, padding: list[int], lengths: list[int]) -> Any:
    import mlx.core as mx

    cache = cls(1, left_padding=padding)
    cache.prepare(lengths=lengths)
    cache[0] = mx.zeros((len(padding), 3))
    mx.eval(cache[0])
    return cache


def metadata(cache: Any) -> tuple[list[int], list[int]]:
    return cache.left_padding.tolist(), cache.lengths.tolist()


def exact_when_taken_out_and_back(cls: type, patch_id: str) -> None:
    """Decrements deferred before the patch goes out reach the attribute; those made while it is out (upstream's
    own ``-=``) and after it is back add up; a writer's new array starts afresh."""
    import mlx.core as mx

    cache = new_cache(cls, [7, 3], [9, 12])
    advance(cache, 23)
    with without(patch_id):
        assert type(vars(cls).get("left_padding")) is not property  # upstream's plain attribute again
        assert vars(cache)["left_padding"].tolist() == [7 - 23, 3 - 23]  # flushed into the attribute itself
        assert not [key for key in vars(cache) if key.startswith("_kvpatch")]
        advance(cache, 13)
    advance(cache, 17, n=2)
    assert metadata(cache) == ([7 - 70, 3 - 70], [9 - 70, 12 - 70])
    cache.left_padding = mx.array([5, 6])  # as prepare/filter/extend/merge do: a new array
    advance(cache, 14)
    assert metadata(cache) == ([5 - 14, 6 - 14], [9 - 84, 12 - 84])
    advance(cache, 40)
    assert max(graph_edges(cache.left_padding), graph_edges(cache.lengths)) <= MAX_EDGES


def decode_ties(arrays_cache: type, steps: int = 60) -> tuple[list[int], Any, Any]:
    """A recurrent layer's cache decoded ``steps`` steps (state read, new state stored, ``advance(1)``, state
    evaluated): the steps whose state entry carried a ``Depends`` node when evaluated, and the final
    ``left_padding`` and ``lengths``. None, unpatched and with ``defer_advance`` alike: the fix defers the metadata
    and ties nothing into the state."""
    import io

    import mlx.core as mx

    cache = arrays_cache(1, left_padding=[4, 1])
    cache.prepare(lengths=[6, 9])
    cache[0] = mx.zeros((2, 3))
    mx.eval(cache[0])
    tied = []
    for step in range(1, steps + 1):
        cache[0] = cache[0] * 0.5 + 1
        cache.advance(1)
        dot = io.StringIO()
        mx.export_to_dot(dot, cache[0])
        if "Depends" in dot.getvalue():
            tied.append(step)
        mx.eval(cache[0])
    return tied, cache.left_padding, cache.lengths


def nothing_joins_the_graph(cls: type) -> None:
    """No step of a decode carries a node kvpatch added; the metadata read after 60 steps is one subtraction."""
    tied, left_padding, lengths = decode_ties(cls, 60)
    assert tied == [], tied
    assert left_padding.tolist() == [4 - 60, 1 - 60] and lengths.tolist() == [6 - 60, 9 - 60]
    assert graph_edges(left_padding) == graph_edges(lengths) <= 5


def reads_do_not_stack(cls: type) -> None:
    """A read never builds on an earlier read's node: reading every step without evaluating keeps the graph at one
    subtraction over the stored array (upstream's chain, read or not, grows by one subtraction per step)."""
    cache = new_cache(cls, [2, 0], [4, 6])
    edges = []
    for _ in range(40):
        advance(cache, 1)
        edges.append((graph_edges(cache.left_padding), graph_edges(cache.lengths), getattr(cache, "batch_size", 2)))
    assert set(edges) == {edges[0]} and edges[0][0] <= 5, edges
    assert metadata(cache) == ([2 - 40, 0 - 40], [4 - 40, 6 - 40])


def copies_stay_exact(cls: type, patch_id: str) -> None:
    """Copies (``copy.copy``, ``copy.deepcopy``: a server's prompt cache) carry the deferred totals with the stored
    array; taking the patch out flushes every one, advanced since or not."""
    cache = new_cache(cls, [5, 2], [8, 9])
    advance(cache, 11)
    shallow, deep, idle = copy.copy(cache), copy.deepcopy(cache), copy.deepcopy(cache)
    advance(cache, 3)
    advance(shallow, 5)
    advance(deep, 7, n=2)
    assert metadata(cache) == ([5 - 14, 2 - 14], [8 - 14, 9 - 14])
    assert metadata(shallow) == ([5 - 16, 2 - 16], [8 - 16, 9 - 16])
    with without(patch_id):
        for each, steps in ((cache, 14), (shallow, 16), (deep, 25), (idle, 11)):
            assert vars(each)["left_padding"].tolist() == [5 - steps, 2 - steps], (each, steps)
            assert vars(each)["lengths"].tolist() == [8 - steps, 9 - steps], (each, steps)
    assert metadata(deep) == ([5 - 25, 2 - 25], [8 - 25, 9 - 25])


def behaves_as_an_attribute(cls: type) -> None:
    """Where upstream's instance attribute would be missing, deleted or set, the descriptor does the same."""
    import mlx.core as mx

    bare = object.__new__(cls)
    vars(bare).pop("left_padding", None)
    assert not hasattr(bare, "left_padding")
    cache = new_cache(cls, [3, 1], [4, 4])
    advance(cache, 2)
    cache.lengths = None  # finalize()
    advance(cache, 3)
    assert cache.lengths is None and cache.left_padding.tolist() == [3 - 5, 1 - 5]
    del cache.left_padding
    assert not hasattr(cache, "left_padding")
    cache.left_padding = mx.array([9, 9])
    assert cache.left_padding.tolist() == [9, 9]


def restore_hook_errors_are_noted(patch: Any) -> None:
    """A restore hook that raises is noted on the status and never raised: taking the patch out still works."""

    def broken() -> None:
        raise RuntimeError("broken on purpose")

    engine = kvpatch.get_engine()
    patch.restore_hooks.append(broken)
    try:
        with warnings.catch_warnings(record=True) as caught, without(patch.id):
            pass
    finally:
        patch.restore_hooks.remove(broken)
    assert len(caught) <= 1, [str(w.message) for w in caught]  # once per process (none if warned before)
    notes = engine.status[patch.id].notes
    assert any("broken on purpose" in note for note in notes), notes
    notes[:] = [note for note in notes if "broken on purpose" not in note]
    assert engine.status[patch.id].installed


def _snapshot(cache: Any) -> dict[str, Any]:
    return dict(vars(cache))


def _same(before: dict[str, Any], after: dict[str, Any]) -> bool:
    return before.keys() == after.keys() and all(after[key] is value for key, value in before.items())


def reads_are_pure(cls: type) -> None:
    """Reading the metadata (and what reads it: ``make_mask``, ``batch_size``, ``state``) from another thread
    stores nothing in the cache, and the owner evaluates its own reads afterwards (mlx streams are per thread: an
    array a reader's read left in the cache fails in the owner with "There is no Stream(cpu, N) in current
    thread")."""
    import threading

    cache = new_cache(cls, [2, 0], [4, 6])
    advance(cache, 5)
    before = _snapshot(cache)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            for _ in range(3):
                cache.left_padding, cache.lengths, cache.make_mask(4), cache.state
                getattr(cache, "batch_size", None)
        except BaseException as exc:  # reported below
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    reader.join()
    assert not errors, errors
    assert _same(before, _snapshot(cache)), (before, _snapshot(cache))
    assert metadata(cache) == ([2 - 5, 0 - 5], [4 - 5, 6 - 5])
    assert _same(before, _snapshot(cache))  # the owner's reads are pure too
    advance(cache, 2)
    assert metadata(cache) == ([2 - 7, 0 - 7], [4 - 7, 6 - 7])


def never_none_during_advance(cls: type) -> None:
    """Whatever runs between two bytecode lines of ``advance`` (another thread, a signal handler) reads the
    metadata as it was before the call or as it is after it, never ``None`` or missing: a trace function reads
    both attributes at every line executed inside the call, deterministically."""
    import sys

    cache = new_cache(cls, [3, 1], [5, 7])
    advance(cache, 2)
    seen: list[Any] = []

    def trace(frame: Any, event: str, _arg: Any) -> Any:
        if event in ("call", "line", "return"):
            seen.append((getattr(cache, "left_padding", "missing"), getattr(cache, "lengths", "missing")))
        return trace

    sys.settrace(trace)
    try:
        cache.advance(1)
    finally:
        sys.settrace(None)
    assert seen
    valid = {((3 - n, 1 - n), (5 - n, 7 - n)) for n in (2, 3)}
    got = {
        tuple(tuple(x.tolist()) if hasattr(x, "tolist") else x for x in pair)  # type: ignore[misc]
        for pair in seen
    }
    # lengths is decremented first, then left_padding, as upstream does: the step between is a state upstream
    # passes through too
    valid.add(((3 - 2, 1 - 2), (5 - 3, 7 - 3)))
    assert got <= valid, got - valid
    assert metadata(cache) == ([0, -2], [2, 4])


def copies_and_pickles_are_upstreams(cls: type) -> None:
    """A copy (``copy.copy`` / ``copy.deepcopy``) or a pickle holds upstream's values in upstream's form: its
    ``vars`` are what upstream's would be (the issue's ``ArraysCache(2, left_padding=[2, 0])`` advanced by 5 gives
    ``[-3, -5]``), with no key of kvpatch's; the original keeps deferring. Upstream's own copy is compared."""
    import pickle

    def upstream_form(each: Any) -> tuple[list[str], list[int], list[int]]:
        state = vars(each)
        return sorted(state), state["left_padding"].tolist(), state["lengths"].tolist()

    cache = cls(2, left_padding=[2, 0])
    cache.prepare(lengths=[6, 4])
    cache.advance(5)
    copies = [copy.copy(cache), copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))]
    forms = [upstream_form(each) for each in copies]
    ref = cls(2, left_padding=[2, 0])
    ref.prepare(lengths=[6, 4])
    ref.advance(5)
    expected = (sorted(k for k in vars(ref) if not k.startswith("_kvpatch")), [-3, -5], [1, -1])
    assert forms == [expected] * 3, forms
    for each in copies:
        each.advance(1)
        assert metadata(each) == ([-4, -6], [0, -2])
    assert metadata(cache) == ([-3, -5], [1, -1])


#: The cases of :func:`edit_cases` where the fix (as mlx-vlm 0.6.16+'s own) differs from upstream's in-place ``-=``
#: (the patch's record says why): an array read earlier and a shallow copy keep their values, an edit made to a read
#: array while decrements are pending stays in that array.
DIFFERS = {
    "reference read with nothing pending, after advance",
    "edit after advance, then advance",
    "shallow copy after the original advances",
}


def edit_cases(cls: type) -> dict[str, Any]:
    """Edits, held references and copies of ``ArraysCache(2, left_padding=[2, 0])`` around ``advance``."""
    out: dict[str, Any] = {}
    cache = cls(2, left_padding=[2, 0])
    lp = cache.left_padding  # nothing pending: the stored array itself
    lp[0] = 100
    cache.advance(5)
    out["edit with nothing pending, then advance"] = cache.left_padding.tolist()
    out["reference read with nothing pending, after advance"] = lp.tolist()
    cache = cls(2, left_padding=[2, 0])
    cache.advance(5)
    lp = cache.left_padding
    lp[0] = 100
    cache.advance(1)
    out["edit after advance, then advance"] = cache.left_padding.tolist()
    cache = cls(2, left_padding=[2, 0])
    cache.advance(5)
    shallow = copy.copy(cache)
    cache.advance(1)
    out["shallow copy after the original advances"] = shallow.left_padding.tolist()
    cache = cls(2, left_padding=[2, 0])
    cache.advance(5)
    cache.left_padding = cache.left_padding
    cache.advance(1)
    out["stored back, then advance"] = cache.left_padding.tolist()
    return out


def edits_and_references_as_documented(cls: type, patch_id: str) -> None:
    """Against upstream's in-place ``-=`` (the same cases with the patch taken out): only the :data:`DIFFERS` cases
    differ; the others give upstream's results."""
    ours = edit_cases(cls)
    with without(patch_id):
        theirs = edit_cases(cls)
    differ = {name for name in ours if ours[name] != theirs[name]}
    assert differ == DIFFERS, (ours, theirs)


def vlm_fixed_class() -> Any:
    """mlx-vlm's own ArraysCache where it is upstream's property-based fix (0.6.16+), else None."""
    try:
        from mlx_vlm.models.cache import ArraysCache
    except ImportError:
        return None
    if not ArraysCache.__module__.startswith("mlx_vlm.") or "_left_padding_advance" not in vars(ArraysCache(1)):
        return None
    return ArraysCache


def vars_snapshot_restores_as_upstream(cls: type, patch_id: str) -> None:
    """mlx-vlm's inkling model (0.6.7+) snapshots an ArraysCache's ``vars`` value by value (each array copied with
    ``mx.array``) and later restores it with ``__dict__.clear()`` / ``update``: the restored cache has the values it
    had at the snapshot, as upstream's does."""
    import mlx.core as mx

    def clone(value: Any) -> Any:
        if isinstance(value, mx.array):
            return mx.array(value)
        if isinstance(value, (tuple, list)):
            return type(value)(clone(v) for v in value)
        return value

    def run() -> tuple[list[int], list[int]]:
        cache = new_cache(cls, [4, 1], [6, 8])
        advance(cache, 3)
        snapshot = {key: clone(value) for key, value in vars(cache).items()}
        advance(cache, 5)
        vars(cache).clear()
        vars(cache).update({key: clone(value) for key, value in snapshot.items()})
        advance(cache, 1)
        return metadata(cache)

    expected = ([4 - 4, 1 - 4], [6 - 4, 8 - 4])
    assert run() == expected
    with without(patch_id):
        assert run() == expected


PICKLED = """
import json, pickle
cache = pickle.loads(bytes.fromhex({hex!r}))
cache.advance(1)
print(json.dumps([cache.left_padding.tolist(), cache.lengths.tolist(), "left_padding" in vars(type(cache))]))
"""


def pickle_loads_where_the_patch_is_off(cls: type, patch_id: str, run_py: Any) -> None:
    """The issue's case: ``ArraysCache(2, left_padding=[2, 0])`` (lengths ``[6, 4]``) advanced by 5 and pickled
    with the patch in; loaded in a child with kvpatch off, and with only this patch off, ``advance(1)`` gives
    upstream's ``[-4, -6]`` (``[0, -2]``)."""
    import json
    import pickle

    cache = cls(2, left_padding=[2, 0])
    cache.prepare(lengths=[6, 4])
    cache.advance(5)
    data = pickle.dumps(cache).hex()
    for env in ({"KVPATCH": "off"}, {"KVPATCH_DISABLE": patch_id}):
        out = json.loads(run_py(PICKLED.format(hex=data), env=env).strip().splitlines()[-1])
        assert out == [[-4, -6], [0, -2], False], (env, out)
