"""offset-rebind: BatchKVCache / BatchRotatingKVCache move ``offset`` in place, so models that keep it RoPE wrong.

Broken: in mlx-lm 0.28.0–0.31.3 the batch caches advance their per-row ``offset`` with ``self.offset += S``.
``+=`` on an ``mx.array`` updates the array object in place, so a model that binds ``offset = cache.offset``
before ``update_and_fetch`` and uses it afterwards reads the post-update value; with the single-sequence
caches (a Python int) the same code is right, so only batched generation (``BatchGenerator``,
``mlx_lm.server``) is wrong. Models that do this in these releases (found by reading every model file of
0.28.0–0.31.3, then measured with tiny random-weight models, batch of two vs each row alone):

* ``gemma3n``: queries get RoPE at ``offset + S`` (keys at ``offset``). Two left-padded prompts: logits off
  by 0.98 after prefill, 0.77 and 0.50 at the next decode steps (0.28.1, 0.31.3; 0.0 with the fix and
  on 0.32.2). Its KV-shared layers also unpack ``cache.state`` as 2 values (ml-explore/mlx-lm#1699),
  a separate crash not patched here (measured with ``num_kv_shared_layers = 0``).
* ``bailing_moe_linear``: the model binds the first global layer's offset once and hands it to every
  linear-attention layer; those after that layer RoPE at ``offset + S``. Two unpadded prompts: prefill
  logits exact, decode off by 0.48 and 0.35 (0.31.3; 0.0 with the fix and on 0.32.2); same code 0.28.4–0.31.3.

``gpt2`` and ``gemma4_text`` copy the offset first and are fine; models that RoPE before the update
build their graph from the old value and are fine. The cache-level symptom (a kept handle changes) is
measured on 0.28.0 (BatchKVCache; no BatchRotatingKVCache yet), 0.28.1, 0.28.4, 0.30.2, 0.30.4, 0.30.7, 0.31.1,
0.31.2 and 0.31.3 (both classes); 0.32.0 rebinds.

Upstream: ml-explore/mlx-lm#1848 (fixes #1806 and #1699's second part; also reported as #1097), released
in 0.32.0 (no public commit for the 0.32 line).

Fix: a delta in front of ``update_and_fetch`` of both classes: the cache's ``offset`` is replaced by a
second handle on the same array (``mx.array(offset)``: no data copy, no graph node, no evaluation) before the
original runs, so the original's in-place ``+=`` / ``-=`` lands on the cache's new handle and a handle a
model kept keeps its value. Values stored and returned are bit-identical. Cost: a decode-step
``BatchKVCache.update_and_fetch`` took 63 us with the patch, 59 us without (0.31.3, CPU, best of 5x2000).
``prepare`` / ``finalize`` / ``trim`` / ``filter`` also move ``offset`` in place but run between forward
passes, where no model holds a handle.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from kvpatch.patches import _offset_rebind
from kvpatch.record import Expiry, Finding, Patch

PATCH = Patch(
    id="offset-rebind",
    summary="BatchKVCache/BatchRotatingKVCache advance offset in place: a model's kept offset moves, RoPE wrong",
    distribution="mlx-lm",
    affected=">=0.28.0,<0.32.0",
    fixed_in="0.32.0",
    catalogue="N6 (issue 12 item 6)",
    reference="ml-explore/mlx-lm#1848",
    hot_path=True,
    order=90,
    expiry=Expiry(
        "retire when kvpatch stops supporting mlx-lm < 0.32.0",
        review_by=_dt.date(2027, 6, 1),
    ),
)


@PATCH.replace("mlx_lm.models.cache", "BatchKVCache.update_and_fetch")
@PATCH.replace("mlx_lm.models.cache", "BatchRotatingKVCache.update_and_fetch", optional=True)
def _build(original: Any) -> Any:
    return _offset_rebind.build(original)


@PATCH.reproduce
def reproduce() -> Finding:
    """Keep ``cache.offset``, update the cache, check the kept handle (both batch classes, S=1 and S=2)."""
    from mlx_lm.models import cache

    found = {"BatchKVCache": cache.BatchKVCache([2, 0])}
    if hasattr(cache, "BatchRotatingKVCache"):
        found["BatchRotatingKVCache"] = cache.BatchRotatingKVCache(16, [2, 0])
    present, detail = _offset_rebind.check(found)
    return Finding(present, detail)
