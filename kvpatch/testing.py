"""Helpers for kvpatch's own tests and for anyone checking a patch by hand.

``unpatched_decision(patch)`` is the gate's decision with the environment's switches ignored, so a test
knows whether the running upstream *should* be patched even when ``KVPATCH_DISABLE`` removed the patch
(that is how a regression test is shown to fail without its patch: run it with the patch disabled).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from . import get_engine
from .config import Config
from .detect import Upstream
from .engine import import_target_modules, run_reproduction
from .gate import Decision, decide
from .record import Finding, Patch

__all__ = ["import_targets", "natural_decision", "reproduce", "reproduce_without", "without"]


def natural_decision(patch: Patch) -> Decision:
    engine = get_engine()
    upstream = engine.upstream.get(patch.distribution) or Upstream(patch.distribution, None)
    return decide(patch, upstream, Config())


def import_targets(patch: Patch) -> None:
    """Import the patch's target modules, so that the engine's hooks have run for them."""
    import_target_modules(patch)


@contextmanager
def without(*patch_ids: str) -> Iterator[None]:
    with get_engine().without(*patch_ids):
        yield


def reproduce(patch: Patch) -> Finding:
    return run_reproduction(patch)


def reproduce_without(patch: Patch) -> Finding:
    with without(patch.id):
        return run_reproduction(patch)
