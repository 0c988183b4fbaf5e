"""batch-logits-processors: both join orders of a mixed batch, and what extend leaves in the batch."""

from __future__ import annotations

import importlib

import pytest

from kvpatch.gate import Action
from kvpatch.patches.mlx_lm.batch_logits_processors import PATCH, _ban_last, run_late_join
from kvpatch.testing import import_targets, natural_decision, tiny_llama, without

pytest.importorskip("mlx.core")

WITH = (list(range(10, 19)), True)
WITHOUT = (list(range(30, 35)), False)


@pytest.fixture(scope="module")
def model():
    decision = natural_decision(PATCH)
    if decision.action is not Action.APPLY:
        pytest.skip(decision.reason)
    import_targets(PATCH)
    return tiny_llama(heads=2, kv_heads=1, vocab=128)


@pytest.mark.parametrize("order", ["processor-first", "processor-joins"])
def test_mixed_batch_matches_each_request_alone(model, order):
    first, second = (WITH, WITHOUT) if order == "processor-first" else (WITHOUT, WITH)
    alone = [run_late_join(model, first, None)[0], run_late_join(model, second, None)[0]]
    assert run_late_join(model, first, second) == alone
    with without(PATCH.id), pytest.raises(TypeError, match="NoneType"):
        run_late_join(model, first, second)


def test_extend_leaves_no_none_slots(model):
    from mlx_lm.models.cache import make_prompt_cache

    generate = importlib.import_module("mlx_lm.generate")

    def batch(uid, processors):
        return generate.PromptProcessingBatch(
            model, [uid], [make_prompt_cache(model)], tokens=[[]], samplers=[None], logits_processors=[processors]
        )

    merged = generate.PromptProcessingBatch.empty(model, lambda x: x.argmax(-1))
    merged.extend(batch(0, [_ban_last]))
    merged.extend(batch(1, []))
    merged.extend(batch(2, [_ban_last]))
    assert merged.logits_processors == [[_ban_last], [], [_ban_last]]
    plain = generate.PromptProcessingBatch.empty(model, lambda x: x.argmax(-1))
    plain.extend(batch(0, []))
    plain.extend(batch(1, []))
    assert plain.logits_processors == [[], []]
