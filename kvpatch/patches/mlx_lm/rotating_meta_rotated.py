"""rotating-meta-rotated: a restored BatchRotatingKVCache always believes it has wrapped.

Broken: in mlx-lm 0.28.1–0.31.3 ``BatchRotatingKVCache.meta_state`` saves ``rotated`` as ``str(bool)`` and
the setter reads it back with ``bool(v[3])``, which is true for ``"False"``. Every cache restored through
``state``/``meta_state`` (``load_prompt_cache`` → ``from_state``, or a prefix-cache restore into a fresh
cache) is marked rotated. The next decode step then takes the wrapped path: ``_update_in_place`` lowers
``left_padding`` by one per token and ``make_mask`` rolls the mask by ``_idx + 1``. Measured (2 rows, left
padding [2, 0], 6 prompt tokens, window 16, state + meta_state restored into a fresh cache, one decode
step): ``left_padding`` becomes [1, -1] instead of [2, 0] and the attention output differs from the
uninterrupted cache by 0.918, on 0.28.1, 0.28.4, 0.30.2, 0.30.4, 0.30.7, 0.31.1, 0.31.2 and 0.31.3. mlx-lm 0.28.0
has no BatchRotatingKVCache; 0.32.0 dropped ``meta_state`` for this class (``state`` carries ``rotated`` as a
bool) and is fine. Through ``load_prompt_cache`` itself, 0.28.4 and later then fail earlier, on a separate
bug: ``from_state`` skips ``__init__`` so ``_lengths`` is missing (``AttributeError`` on the first decode step,
0.28.4–0.32.2); on 0.28.1 (no ``_lengths``) the file round trip gives the same 0.918 error.

Upstream: ml-explore/mlx-lm#1250 (closed); fixed in 0.32.0 by the cache-state rewrite (no public commit).

Fix: a delta around the property's setter: the original setter runs, then ``rotated`` is set from the
string exactly as ``meta_state`` wrote it (``"True"`` / ``"False"``). A non-string flag is left as the
original set it. Runs once per restore, never per token.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _meta_rotated
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="rotating-meta-rotated",
    summary="BatchRotatingKVCache.meta_state setter reads rotated with bool('False'): restored caches look wrapped",
    distribution="mlx-lm",
    affected=">=0.28.1,<0.32.0",
    fixed_in="0.32.0",
    catalogue="N7 (issue 12 item 7)",
    reference="ml-explore/mlx-lm#1250",
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-lm < 0.32.0",
        review_by=_dt.date(2027, 6, 1),
    ),
)


@PATCH.replace("mlx_lm.models.cache", "BatchRotatingKVCache.meta_state")
def _build(original: Any) -> Any:
    return _meta_rotated.build_setter(original)


@PATCH.reproduce
def reproduce() -> Finding:
    """Restore a non-rotated batch rotating cache via state + meta_state; one decode step must match."""
    from mlx_lm.models import cache

    return _meta_rotated.reproduce(cache)
