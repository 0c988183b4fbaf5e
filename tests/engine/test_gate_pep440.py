"""The gate reads any PEP 440 range and version through packaging: releases, pre-releases, local builds, ``~=``."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("affected", "fixed_in", "installed", "action"),
    [
        ("~=0.31.0", "0.32.0", "0.31.3", "APPLY"),
        ("~=0.31.0", "0.32.0", "0.30.4", "VERIFY"),  # below ~= is not read as a lower bound
        (">=0.31.0,<0.32.0", "0.32.0", "0.31.3", "APPLY"),
        (">=0.31.0,<0.32.0", "0.32.0", "0.32.0rc1", "VERIFY"),  # a pre-release of the fix
        (">=0.31.0,<0.32.0", "0.32.0", "0.31.3+local", "APPLY"),
        (">=0.31.0,<0.32.0", "0.32.0", "0.33.0", "NOT_NEEDED"),
    ],
)
def test_gate_reads_pep440(affected, fixed_in, installed, action):
    from support import synthetic_patch

    from kvpatch.config import Config
    from kvpatch.detect import Source, Upstream
    from kvpatch.gate import Action, decide

    patch = synthetic_patch("mixed", affected=affected, fixed_in=fixed_in)
    decision = decide(patch, Upstream("mlx-lm", installed, Source(), location="/x"), Config())
    assert decision.action is Action[action], decision
