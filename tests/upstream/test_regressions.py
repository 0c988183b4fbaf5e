"""Every patch's reproduction is its regression test, run against the real installed upstream.

On an affected release: the bug is absent in this (patched) process, and present with the patch taken
out (:meth:`kvpatch.engine.Engine.measure`: its siblings on the same targets out too, enablers kept). A patch its
reproduction decides here (an archive or editable install, a release newer than the record's) and that has no verdict
yet is settled first as ``kvpatch verify`` settles it (:class:`kvpatch.verifier.Verifier`). Run with
``KVPATCH_DISABLE=<id>`` (or ``KVPATCH=off``) to see the test fail without the patch.
On a fixed release: the patch is not applied and the bug is absent.

Findings are three-valued: the assertions name what they want of the bug (``present`` / ``absent``), so an
inconclusive finding (an error that is not the bug's own symptom) fails the test with its error rather
than passing for "absent".
"""

from __future__ import annotations

import sys

import pytest

import kvpatch
from kvpatch import registry
from kvpatch.gate import Action
from kvpatch.maint.expiry import patch_file
from kvpatch.maint.upstream_check import absent_advice
from kvpatch.states import State
from kvpatch.testing import import_targets, natural_decision, reproduce, skip_on_gap
from kvpatch.verifier import Verifier

PATCHES = registry.load().patches
METAL = sys.platform == "darwin"


@pytest.mark.parametrize("patch", PATCHES, ids=[p.id for p in PATCHES])
def test_regression(patch):
    engine = kvpatch.get_engine()
    decision = natural_decision(patch)
    if decision.action in (Action.NOT_INSTALLED, Action.OUT_OF_RANGE):
        pytest.skip(decision.reason)
    if patch.metal_only and not METAL:
        pytest.skip(
            f"{patch.id} is a Metal-only bug: it cannot be reproduced on this backend; gated by version and commit only"
        )
    import_targets(patch)
    st = engine.status[patch.id]
    if decision.action is Action.NOT_NEEDED:
        # (disabled too when run with KVPATCH_DISABLE: what matters is that nothing is installed)
        assert st.state in (State.NOT_NEEDED, State.DISABLED) and not st.installed, st.reason
        finding = reproduce(patch)
        assert finding.bug == "absent", (
            f"{patch_file(patch)}: the record says this release has upstream's fix (fixed_in={patch.fixed_in!r}, "
            f"fixed_commit={patch.fixed_commit!r}), but {_said(finding)}: set them (and affected's upper bound) to the "
            "release and commit that really fix it"
        )
        return
    if decision.action is Action.VERIFY and st.state is State.UNVERIFIED:
        # the reproduction decides and this environment has no verdict: nothing was applied at import; settled now
        assert not st.installed, st.reason
        Verifier(engine, "test").verify(st)
    # APPLY (or VERIFY, settled by this environment's verdict)
    if not st.installed:
        finding = reproduce(patch)
        if finding.skipped:
            # a bug of one backend (e.g. CUDA only): its builder declines the others, nothing is installed
            pytest.skip(f"{patch.id}: {finding.skipped}")
        assert finding.bug == "absent", f"in this process ({st.state.value}: {st.reason}) {_said(finding)}"
        assert decision.action is not Action.APPLY or st.state is State.APPLIED, st.reason
        return
    measured = st.measurement or engine.measure(patch, install=False)
    unpatched, finding = skip_on_gap(measured.before), skip_on_gap(measured.after)
    assert not finding.skipped, f"{patch.id} is installed although its reproduction cannot run here"
    assert finding.bug == "absent", f"in this process ({st.state.value}: {st.reason}) {_said(finding)}"
    if decision.action is Action.APPLY:
        assert st.state is State.APPLIED, st.reason
    assert unpatched.bug == "present", f"without the patch {_said(unpatched)}" + (
        "\n" + "\n".join(_absent_advice(patch, engine.upstream[patch.distribution]))
        if unpatched.bug == "absent"
        else ""
    )


def _absent_advice(patch, upstream):
    commit = upstream.source.commit if upstream.source.kind == "vcs" else None
    return absent_advice(patch, upstream.version, commit=commit)


@pytest.mark.parametrize("flag", [None, "on_device", "metal_only"])
def test_a_reproduction_runs_where_its_bug_lives(flag):
    """A logic bug's reproduction runs on the CPU stream, whatever the default device (its verdict is then the same
    on every machine); a device kernel's bug on the default device. Meaningful on a GPU host: on a CPU-only one both
    are the CPU."""
    import mlx.core as mx
    from support import synthetic_patch

    from kvpatch.engine import run_reproduction
    from kvpatch.record import Finding

    record = synthetic_patch("where-it-runs", **({flag: True} if flag else {}))
    seen = []
    record.reproduction = lambda: seen.append(mx.default_device()) or Finding(False, "measured")
    default = mx.default_device()
    assert run_reproduction(record).bug == "absent"
    assert seen == [default if flag else mx.Device(mx.cpu)]
    assert mx.default_device() == default  # given back
    assert run_reproduction(record, "default").bug == "absent" and seen[-1] == default


def _said(finding):
    what = finding.inconclusive or finding.skipped or finding.detail
    return f"the reproduction says {finding.bug.value}: {what}"
