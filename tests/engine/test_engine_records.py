"""What the engine hands out: ``records()`` gives real :class:`kvpatch.Patch` records (index stubs are resolved
there, never by an attribute read), and a builder that declines is asked once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from support import child_env, fake_mlx_core


def _run(code: str, tmp_path, **env: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=child_env(env),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("@@"))[2:])


def test_records_are_patches_and_stubs_import_nothing(tmp_path):
    out = _run(
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


#: A patch of ``_site``'s ``C.f`` whose reproduction decides it (a release past ``checked_through``); ``BUILDS``
#: counts its builder's runs.
DEMO = """
from kvpatch.record import Expiry, Finding, Patch
p = Patch(id="demo", summary="demo", distribution="mlx-lm", affected=">=0.1.0,<=0.1.0",
          checked_through="0.1.0", reference="none", expiry=Expiry("never"))
p.module = "kvpatch"
BUILDS = []

@p.replace("mlx_lm.models.cache", "C.f")
def build(original):
    BUILDS.append(1)
    def f(self):
        return 2
    return f

@p.reproduce
def reproduce():
    import mlx_lm.models.cache as c
    return Finding(c.C().f() == 1, "f() said %d" % c.C().f())
"""
DEMO = textwrap.indent(DEMO, " " * 8)  # as indented as the programs it goes into (dedented whole)


def _site(tmp_path, version: str = "0.1.0"):
    """A site folder with a small mlx_lm (one class) and the little of mlx.core a reproduction run touches."""
    site = tmp_path / "site"
    (site / "mlx_lm" / "models").mkdir(parents=True)
    (site / "mlx_lm" / "__init__.py").write_text("")
    (site / "mlx_lm" / "models" / "__init__.py").write_text("")
    (site / "mlx_lm" / "models" / "cache.py").write_text("class C:\n    def f(self):\n        return 1\n")
    fake_mlx_core(site)
    info = site / f"mlx_lm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: mlx-lm\nVersion: {version}\n")
    return os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])


def test_status_verify_runs_each_side_once(tmp_path):
    """A patch the reproduction decides (a release past checked_through): ``status --verify`` measures it once
    without and once with the patch (the engine's measurement is the one the report shows)."""
    out = _run(
        """
        import json
        from kvpatch import status
        from kvpatch.config import Config
        from kvpatch.engine import REPRODUCTIONS_RUN, Engine
        """
        + DEMO
        + """
        engine = Engine([p], config=Config())
        engine.activate()
        report = status.build_report(engine, verify=True)
        entry = report.data["patches"][0]
        print("@@" + json.dumps({"runs": len(REPRODUCTIONS_RUN), "action": entry["action"], "state": entry["state"],
                                 "outcome": entry["verify"]["outcome"]}))
        """,
        tmp_path,
        PYTHONPATH=_site(tmp_path, "0.2.0"),
        KVPATCH="off",
        KVPATCH_VERDICTS=str(tmp_path / "verdicts"),
    )
    assert out == {"runs": 2, "action": "verify", "state": "applied", "outcome": "bug present, fixed by patch"}, out


def test_a_declining_builder_is_asked_once(tmp_path):
    out = _run(
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
        PYTHONPATH=_site(tmp_path),
        KVPATCH="off",
    )
    assert out == {"calls": 1, "state": "not needed"}, out


def test_a_builder_is_asked_once_per_install(tmp_path):
    """A patch its verdict settles: deciding whether it declines builds the replacement that is then installed."""
    out = _run(
        """
        import json
        from kvpatch import verdicts
        from kvpatch.config import Config
        from kvpatch.engine import Engine
        from kvpatch.verifier import Verifier
        """
        + DEMO
        + """
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
        PYTHONPATH=_site(tmp_path, "0.2.0"),
        KVPATCH="off",
        KVPATCH_VERDICTS=str(tmp_path / "verdicts"),
    )
    assert out == {"calls": 1, "state": "applied"}, out
