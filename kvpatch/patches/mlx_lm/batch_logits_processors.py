"""batch-logits-processors (catalogue X1): a mixed batch gets ``None`` logits-processor slots and crashes.

Broken: in 0.31.2–0.31.3 ``mlx_lm.generate.PromptProcessingBatch.extend`` fills the logits-processor list
of whichever side has no processors with ``None`` (``[None] * len(uids)``). When rows with and rows without
logits processors share the prompt batch and move to generation together, ``GenerationBatch._step`` sees
``any(self.logits_processors)`` true and runs ``for processor in self.logits_processors[e]`` over the
``None`` slot: ``TypeError: 'NoneType' object is not iterable``, which ends ``BatchGenerator.next()`` for
every request in the batch. Measured with a real ``BatchGenerator`` on a tiny llama (``prefill_step_size=4``):
a 9-token request with a processor is prefilling when a 5-token request without one is inserted (or the
other way round); both finish prefill on the same step and the next ``next()`` raises. Rows inserted
together, or before the first ``next()``, do not trigger it (no ``extend`` of a non-empty batch). Samplers
get the same ``None`` fill, but the step handles it (``samplers[e] or fallback``). Introduced by 3f9d179f
(#1072, first released in 0.31.2, where ``PromptProcessingBatch`` appears); 0.32.0 and 0.32.1/0.32.2 extend
the lists as they are and are clean (no public commit for the 0.32 line; upstream main as mirrored still
has the ``None`` fill). Not reported upstream as such (reported by downstream servers).

Fix: a delta after the original. Once ``extend`` has run, ``None`` slots in ``logits_processors`` become
``[]`` (no processors), the value ``PromptProcessingBatch.filter`` itself uses for rows without processors,
so the generation step iterates an empty list for those rows and applies the real processors to the others.
Nothing else is touched. Cold path: ``extend`` runs when new requests join the prompt batch, not per token.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _reproduce
from kvpatch.record import Expiry, Finding, Patch, symptom

PATCH = Patch(
    id="batch-logits-processors",
    summary="PromptProcessingBatch.extend writes None logits-processor slots: mixed batches crash in the decode step",
    distribution="mlx-lm",
    affected=">=0.31.2,<0.32.0",
    fixed_in="0.32.0",
    introduced_commit="3f9d179f",
    reference="not reported upstream (downstream servers; introduced by ml-explore/mlx-lm#1072)",
    catalogue="X1",
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-lm < 0.32.0",
        review_by=_dt.date(2027, 6, 1),
    ),
)


@PATCH.replace("mlx_lm.generate", "PromptProcessingBatch.extend")
def _build(original: Any) -> Any:
    def extend(self: Any, batch: Any) -> None:
        original(self, batch)
        processors = self.logits_processors
        if any(p is None for p in processors):
            self.logits_processors = [[] if p is None else p for p in processors]

    return extend


def _ban_last(tokens: Any, logits: Any) -> Any:
    """Forbid repeating the previous token (the tiny model would otherwise repeat one token forever)."""
    import mlx.core as mx

    last = tokens.reshape(-1)[-1]
    return logits - 1e9 * (mx.arange(logits.shape[-1]) == last)


def run_late_join(model: Any, first: tuple[list[int], bool], second: tuple[list[int], bool] | None) -> list[list[int]]:
    """Insert ``first``, step once (it is still prefilling), insert ``second``, decode both to the end.

    Each request is ``(prompt, with_processor)``; returns the generated tokens per request.
    """
    import importlib

    generate = importlib.import_module("mlx_lm.generate")
    generator = generate.BatchGenerator(model, prefill_step_size=4, max_tokens=6)
    uids: list[int] = []
    out: dict[int, list[int]] = {}
    finished: set[int] = set()

    def insert(request: tuple[list[int], bool]) -> None:
        prompt, with_processor = request
        uids.extend(generator.insert([prompt], logits_processors=[[_ban_last]] if with_processor else None))

    def step() -> None:
        responses = generator.next()
        if isinstance(responses, tuple):
            responses = responses[1]
        for r in responses:
            out.setdefault(r.uid, []).append(r.token)
            if r.finish_reason is not None:
                finished.add(r.uid)

    insert(first)
    step()
    if second is not None:
        insert(second)
    for _ in range(40):
        if len(finished) == len(uids):
            break
        step()
    return [out.get(u, []) for u in uids]


_NONE = "'NoneType' object is not iterable"  # the bug's own error: the joining request's processors


@PATCH.reproduce
def reproduce() -> Finding:
    """A request without processors joins one with processors mid-prefill: batched tokens == each alone."""
    model = _reproduce.tiny_llama(heads=2, kv_heads=1, vocab=128)
    with_processor = (list(range(10, 19)), True)
    without_processor = (list(range(30, 35)), False)
    reference = [run_late_join(model, r, None)[0] for r in (with_processor, without_processor)]
    try:
        batched = run_late_join(model, with_processor, without_processor)
    except TypeError as exc:  # the bug's own error: the joining request's processors are None
        return Finding(True, f"mixed batch raises TypeError: {symptom(exc, _NONE)}")
    if batched != reference:
        return Finding(True, f"mixed batch decodes {batched}, each request alone {reference}")
    return Finding(False, f"mixed batch == each request alone: {batched}")
