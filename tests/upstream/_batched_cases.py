"""The model-level cases of patches found by the bug hunt (gemma2-batch-mask, vlm-gemma2-batch-mask,
vlm-mask-cache-list): a tiny random-weight model over left-padded batches of several shapes gives each prompt the
logits it has alone, prefill and two decode steps (``_reproduce.model_rows_vs_alone``). Prompts of one length get no
per-row mask: that case passes with or without the patch."""

from __future__ import annotations

from typing import Any

from kvpatch.patches._reproduce import model_rows_vs_alone
from kvpatch.testing import worst

LENGTHS = [(5, 2), (3, 7, 4), (4, 4)]


def rows_agree(model: Any, caches: Any, lengths: tuple[int, ...]) -> None:
    found = worst(model_rows_vs_alone(model, caches, lengths, 2))
    assert found is not None and found.within, found
