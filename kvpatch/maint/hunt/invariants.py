"""The invariants the hunt checks, each stated once. The hunt knows these, never a bug: a finding is the first
operation after which one of them no longer holds.

Cache level: a batch cache is judged against the single-row caches it stands for (each row's tokens fed alone,
one at a time, through a cache of the matching single-row class: ``BatchKVCache`` rows against ``KVCache``,
``BatchRotatingKVCache`` against ``RotatingKVCache`` of the same window, the quantized and TurboQuant batch caches
against their single-row classes of the same bits); a single-row cache is judged against itself fed one token at a
time. Model level: a batch of left-padded prompts against each prompt alone.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Invariant:
    name: str
    statement: str
    level: str  # "cache" or "model"


_ALL = (
    Invariant(
        "no-crash",
        "every operation the cache offers runs on any state the other operations leave it in",
        "cache",
    ),
    Invariant(
        "has-operations",
        "a batch cache class offers the batch operations (prepare, finalize, filter, extend, extract, make_mask) that "
        "its package's BatchKVCache offers",
        "cache",
    ),
    Invariant(
        "rows-agree",
        "each row's attention through the batch cache (its mask, keys and values) equals that row's tokens fed alone "
        "to its own single-row cache, up to rounding",
        "cache",
    ),
    Invariant("offsets-agree", "each row's offset equals its own single-row cache's offset, exactly", "cache"),
    Invariant(
        "dtype-kept",
        "attention through the cache, and the keys and values it hands back (extract, dequantize), keep the dtype fed",
        "cache",
    ),
    Invariant(
        "new-keys-held",
        "update_and_fetch returns, among the keys it hands back, every key it was just given",
        "cache",
    ),
    Invariant(
        "kept-handle",
        "a metadata array read from the cache before update_and_fetch keeps its value (a model may hold it)",
        "cache",
    ),
    Invariant(
        "trimmable-agrees",
        "a batch cache says is_trimmable() exactly when every row's own cache does",
        "cache",
    ),
    Invariant(
        "extract-agrees",
        "extract(i) is row i's own cache: the same offset, dtype and next attention step",
        "cache",
    ),
    Invariant("nbytes-reads", "nbytes reads without error and is a non-negative integer", "cache"),
    Invariant(
        "states-agree",
        "each row's recurrent state in a batch ArraysCache equals that row's inputs fed alone, up to rounding",
        "cache",
    ),
    Invariant(
        "lazy-bounded",
        "the unevaluated graph behind a cache's metadata arrays stays bounded over decode steps and over rows "
        "joining and leaving, when nothing but the outputs is evaluated",
        "cache",
    ),
    Invariant(
        "logits-agree",
        "batched generation of left-padded prompts gives each row the same log-probabilities as that prompt alone, "
        "up to rounding",
        "model",
    ),
    Invariant("model-runs", "batched generation runs for every architecture that runs alone", "model"),
)

INVARIANTS: dict[str, Invariant] = {i.name: i for i in _ALL}
