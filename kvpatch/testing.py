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
    return decide(patch, upstream, Config(enable_all=True))


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


def require_affected(patch: Patch) -> Decision:
    """For tests: skip unless the installed upstream has the patch's range in play; import its targets.

    Skips (through pytest) when the distribution is absent or predates the bug; otherwise imports
    the target modules so the engine's hooks have run, and returns the natural decision.
    """
    import pytest

    from .gate import Action

    decision = natural_decision(patch)
    if decision.action in (Action.NOT_INSTALLED, Action.OUT_OF_RANGE):
        pytest.skip(f"{patch.id}: {decision.reason}")
    import_target_modules(patch)
    return decision


def tiny_llama(*, seed: int = 0, heads: int = 4, kv_heads: int = 2, vocab: int = 64, dtype: object = None) -> object:
    """A random-weight mlx-lm llama (hidden 64, 2 layers): the test model. No downloads."""
    import mlx.core as mx
    from mlx_lm.models import llama

    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        rope_theta=10000.0,
    )
    model = llama.Model(args)
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def tiny_pixtral_language_model(*, head_dim: int, heads: int = 4, kv_heads: int = 2, dtype: object = None) -> object:
    """A random-weight mlx-vlm language model (pixtral's, hidden 64, 2 layers): the mlx-vlm test model."""
    import mlx.core as mx
    from mlx_vlm.models.pixtral.config import TextConfig
    from mlx_vlm.models.pixtral.language import LanguageModel

    mx.random.seed(0)
    config = TextConfig(
        model_type="mistral",
        hidden_size=64,
        head_dim=head_dim,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=64,
        rope_theta=10000.0,
    )
    model = LanguageModel(config)
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def skip_unless_in_place(patch_id: str, why: str) -> None:
    """For tests that rely on another patch: skip when the running upstream needs it and it is not installed
    (e.g. run with ``KVPATCH_DISABLE``), so that only that patch's own tests fail."""
    import pytest

    from .gate import Action

    st = get_engine().status.get(patch_id)
    if st is not None and natural_decision(st.patch).action is Action.APPLY and not st.installed:
        pytest.skip(f"this release also has {why} and {patch_id} is not applied")
