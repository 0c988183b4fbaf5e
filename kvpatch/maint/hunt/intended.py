"""Upstream behaviour that breaks an invariant on purpose, with where upstream says so: a finding that matches is
attributed ``intended``, not ``new``. Entries describe upstream's documented behaviour, never a kvpatch patch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Intended:
    target: str  # regular expression over the class (``module.Class``)
    invariant: str
    detail: str  # regular expression over the finding's detail
    reference: str  # where upstream documents or states the behaviour


INTENDED: tuple[Intended, ...] = (
    Intended(
        r"\.BatchRotatingKVCache$",
        "no-crash",
        r"finalize\(\) should be called before",
        "mlx-lm's BatchRotatingKVCache.update_and_fetch raises this RuntimeError itself: a right-padded prefill must "
        "be finalized before a single-token step (mlx_lm/models/cache.py, BatchRotatingKVCache.update_and_fetch)",
    ),
    Intended(
        r"",
        "model-runs",
        r"does not yet support batching",
        "the batch path refuses a model whose caches it cannot batch with this ValueError of its own (mlx-lm's "
        "mlx_lm/generate.py and mlx-vlm's generate module, _make_cache / _merge_caches)",
    ),
)


def match(finding: dict[str, Any]) -> str | None:
    """The reference of the documented behaviour ``finding`` is, or None."""
    for entry in INTENDED:
        if (
            entry.invariant == finding.get("invariant")
            and re.search(entry.target, finding.get("target", ""))
            and re.search(entry.detail, finding.get("detail", ""))
        ):
            return entry.reference
    return None
