"""batch-extract-right-padding: mlx-lm's batch caches' ``extract`` copies pending right padding into the row's cache.

Broken: a right-padded multi-row prefill declares its padding with ``prepare(right_padding=..., lengths=...)``;
each short row's pad tokens are written after its real tokens and stay at the tail of the written region until
``finalize()`` rolls them to the front as left padding. ``mlx_lm.models.cache.BatchKVCache.extract`` and
``BatchRotatingKVCache.extract`` copy everything from the row's left padding to the write index, pads
included, and count them. Measured (Linux, mlx[cpu], ``KVPATCH=off``): rows of 3 and 5 tokens padded to 5,
``prepare(right_padding=[2, 0], lengths=[3, 5])``, one 5-token update (or 3 + 2 in two chunks), ``extract(0)``:
a ``KVCache`` (``RotatingKVCache``) holding 5 positions with ``offset = 5`` instead of 3, in both classes, on
0.28.4, 0.31.2 and 0.32.2; the row continued from it attends to two pad positions and its RoPE positions are 2
ahead (the next decode step's attention output differs from the row prefilled alone). Extracting before the
row's pads are written (after 3 of the 5 columns) is right, and stays so under this patch. ``prepare`` /
``extract`` first appear in 0.28.4 (088e7ad7, ml-explore/mlx-lm#602): the range starts there. Not fixed as of
0.32.2; ml-explore/mlx-lm#1746 proposed a fix and was closed unmerged. mlx-vlm's own copies (0.6.4+) have the
same bug: patch ``batch-extract-right-padding-vlm``.

How users meet it: not through mlx-lm's own generators, whose ``PromptProcessingBatch.prompt`` (and
``_process_prompts`` before 0.31) runs ``prepare``, the model and ``finalize`` inside one call, so
``extract_cache`` (server prompt-cache stores, ``remove(return_prompt_caches=True)``) never sees pending
padding. It is met by code that drives the cache API itself and saves a row's cache between the prefill and
``finalize`` (a segment-boundary prompt-cache store, a row handed to another scheduler): the saved entry is
silently corrupt, and reusing it gives mask/key length mismatches or wrong tokens.

Fix (``kvpatch/patches/_right_padding.py``): ``extract`` is a delta after the original: the row's pads written so
far are the last positions of the single-row cache it returns, and are cut off (keys, values, ``offset``, and
``_idx`` of the ``RotatingKVCache``); the live batch cache is not changed. (Lowering the write index before the
original would not do: 0.28.4-0.30.x's rotating ``extract`` returns the whole buffer when the row has no left
padding, measured: the next decode step then differs by 3.46.) The rotating class keeps
``_lengths`` (``offset + lengths``) itself: written pads are ``max(0, offset - _lengths)``, what its
``finalize`` rolls. ``BatchKVCache`` drops ``lengths``, so ``prepare`` gets a delta that keeps
``offset + lengths`` in a private attribute, and ``filter`` one that filters it with the rows (as
``lm-filter-right-padding`` does for ``_right_padding``); without ``lengths`` every declared pad counts as
written (``finalize``'s own assumption). None of these runs per token; ``extract`` reads the row's pending
count on the host, as the original reads its padding.
"""

from __future__ import annotations

import datetime as _dt

from kvpatch.patches import _pending, _right_padding
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="batch-extract-right-padding",
    summary="batch cache extract() during a right-padded prefill copies the pad tokens into the row's cache",
    distribution="mlx-lm",
    affected=">=0.28.4,<=0.32.2",
    introduced_commit="088e7ad7",
    checked_through="0.32.2",
    catalogue="N2 (issue 12 item 2)",
    reference="ml-explore/mlx-lm#1746 (closed unmerged)",
    expiry=Expiry(
        "retire when mlx-lm's BatchKVCache/BatchRotatingKVCache.extract leave pending right padding out "
        "(set fixed_in then) and kvpatch stops supporting the releases before",
        review_by=_dt.date(2027, 3, 1),
    ),
)

PATCH.replace("mlx_lm.models.cache", "BatchKVCache.prepare")(_right_padding.record_ends)
PATCH.replace("mlx_lm.models.cache", "BatchKVCache.filter")(_pending.filter_pending(_right_padding.ENDS))
PATCH.replace("mlx_lm.models.cache", "BatchKVCache.extract")(
    _right_padding.extract_without_pending(_right_padding.dense_pending)
)
PATCH.replace("mlx_lm.models.cache", "BatchRotatingKVCache.extract")(
    _right_padding.extract_without_pending(_right_padding.rotating_pending)
)


@PATCH.reproduce
def reproduce() -> Finding:
    """Prefill rows of 3 and 5 tokens right-padded to 5 (in one chunk, and in chunks of 3 and 2), extract both
    rows before ``finalize()``, and compare each extracted cache with the row prefilled alone: offset, stored
    keys and the next decode step's attention output."""
    from mlx_lm.models import cache as cache_module

    classes = {
        "BatchKVCache": (lambda n: cache_module.BatchKVCache([0] * n), cache_module.KVCache),
        "BatchRotatingKVCache": (
            lambda n: cache_module.BatchRotatingKVCache(16, [0] * n),
            lambda: cache_module.RotatingKVCache(16),
        ),
    }
    return _right_padding.extract_finding(classes)
