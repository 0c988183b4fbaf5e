"""What the engine hands out: ``records()`` gives real :class:`kvpatch.Patch` records (index stubs are resolved
there, never by an attribute read), and a builder that declines is asked once."""

from __future__ import annotations

from support import DEMO_PATCH, fake_upstream, run_child


def test_records_are_patches_and_stubs_import_nothing(tmp_path):
    out = run_child(
        """
        import json, sys
        import kvpatch
        from kvpatch import registry
        engine = kvpatch.get_engine()
        units = lambda: sorted(m for m in sys.modules if m.startswith("kvpatch.patches.") and "._" not in m)
        stubs = [st.patch for st in engine.status.values() if isinstance(st.patch, registry.Stub)]
        before = units()
        fields = [(s.id, s.distribution, s.affected, s.order) for s in stubs]  # reads import nothing
        after_reads = units()
        records = kvpatch.records()
        print("@@" + json.dumps({
            "stubs": len(stubs), "before": before, "after_reads": after_reads,
            "all_patches": all(isinstance(r.patch, kvpatch.Patch) for r in records),
            "count": len(records) == len(engine.status),
        }))
        """,
        tmp_path,
    )
    assert out["stubs"] > 0, out  # no mlx here: every unit is settled by the index, none imported
    assert out["after_reads"] == out["before"], out
    assert out["all_patches"] and out["count"], out


def test_status_verify_runs_each_side_once(tmp_path):
    """A patch the reproduction decides (a release past checked_through): ``status --verify`` measures it once
    without and once with the patch (the engine's measurement is the one the report shows)."""
    out = run_child(
        DEMO_PATCH
        + """
from kvpatch import status
from kvpatch.engine import REPRODUCTIONS_RUN
p = patch("demo", ">=0.1.0,<=0.1.0", checked_through="0.1.0")
engine = Engine([p], config=Config())
engine.activate()
report = status.build_report(engine, verify=True)
entry = report.data["patches"][0]
print("@@" + json.dumps({"runs": len(REPRODUCTIONS_RUN), "action": entry["action"], "state": entry["state"],
                         "outcome": entry["verify"]["outcome"]}))
""",
        tmp_path,
        PYTHONPATH=fake_upstream(tmp_path, "0.2.0"),
        KVPATCH="off",
        KVPATCH_VERDICTS=str(tmp_path / "verdicts"),
    )
    assert out == {"runs": 2, "action": "verify", "state": "applied", "outcome": "bug present, fixed by patch"}, out


def test_a_declining_builder_is_asked_once(tmp_path):
    out = run_child(
        """
        import json
        from kvpatch.config import Config
        from kvpatch.engine import Engine
        from kvpatch.record import Expiry, Finding, Patch
        p = Patch(id="declines", summary="demo", distribution="mlx-lm", affected=">=0.1.0,<0.2.0", fixed_in="0.2.0",
                  reference="none", expiry=Expiry("never"))
        calls = []

        @p.replace("mlx_lm.models.cache", "C.f")
        def build(original):
            calls.append(1)
            return original  # nothing to change on this backend

        p.reproduce(lambda: Finding(False))
        engine = Engine([p], config=Config())
        engine.activate()
        import mlx_lm.models.cache
        st = engine.status["declines"]
        print("@@" + json.dumps({"calls": len(calls), "state": st.state.value}))
        """,
        tmp_path,
        PYTHONPATH=fake_upstream(tmp_path, "0.1.0"),
        KVPATCH="off",
    )
    assert out == {"calls": 1, "state": "not needed"}, out


def test_a_builder_is_asked_once_per_install(tmp_path):
    """A patch its verdict settles: deciding whether it declines builds the replacement that is then installed."""
    out = run_child(
        DEMO_PATCH
        + """
from kvpatch.verifier import Verifier
p = patch("demo", ">=0.1.0,<=0.1.0", checked_through="0.1.0")
first = Engine([p], config=Config())
first.activate()
Verifier(first, "verify").run()  # measures and stores the verdict
first.deactivate()
BUILDS.clear()
engine = Engine([p], config=Config())  # reads the stored verdict
engine.activate()
print("@@" + json.dumps({"calls": len(BUILDS), "state": engine.status["demo"].state.value}))
""",
        tmp_path,
        PYTHONPATH=fake_upstream(tmp_path, "0.2.0"),
        KVPATCH="off",
        KVPATCH_VERDICTS=str(tmp_path / "verdicts"),
    )
    assert out == {"calls": 1, "state": "applied"}, out
