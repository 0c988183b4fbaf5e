"""The unit index (``kvpatch/data/units.json``): auto-activation gates from it and imports only the units
that can apply; it must say what the units say, and a stub must decide as its record does."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kvpatch import registry
from kvpatch.config import Config
from kvpatch.detect import Source, Upstream
from kvpatch.gate import decide
from kvpatch.maint import units

RECORDS = registry.load().patches

# Installs the gate tells apart: releases across every range, a newer one, archive and git installs, absent.
_VERSIONS = ("0.19.3", "0.22.0", "0.26.1", "0.28.4", "0.30.4", "0.31.2", "0.32.0", "0.32.2", "0.33.0", "0.6.4",
             "0.6.15", "0.7.10", "0.8.0", "0.32.2.dev0", "0.32.2+local")  # fmt: skip
_SOURCES = (Source(), Source(kind="archive", url="file:///w.whl"), Source(kind="vcs", commit="0" * 40))


def test_index_says_what_the_units_say():
    current = registry.INDEX.read_text(encoding="utf-8")
    assert current == units.render(units.expected()), "stale: run python -m kvpatch.maint.regenerate"


def test_stub_decides_as_its_record():
    stubs = {s.id: s for s in registry.index() or []}
    assert sorted(stubs) == sorted(p.id for p in RECORDS)
    configs = (Config(), Config(enabled_ids=frozenset(p.id for p in RECORDS)), Config(enabled=False))
    for record in RECORDS:
        stub = stubs[record.id]
        for config in configs:
            ups = [Upstream(record.distribution, v, s) for v in _VERSIONS for s in _SOURCES]
            for upstream in [*ups, Upstream(record.distribution, None)]:
                assert decide(stub, upstream, config) == decide(record, upstream, config), (record.id, upstream)


def test_stub_holds_the_indexed_fields_only_and_resolves_to_its_record():
    stub = next(s for s in registry.index() or [] if s.id == "mask-fill")
    record = next(p for p in registry.load().patches if p.id == "mask-fill")
    assert all(getattr(stub, name) == getattr(record, name) for name in units.INDEXED)
    assert not hasattr(stub, "summary")  # a read never imports the unit
    assert stub.resolve() is record


def test_index_not_matching_the_units_is_not_used(monkeypatch):
    names = registry._unit_names()
    monkeypatch.setattr(registry, "_unit_names", lambda: [*names, f"{registry.PACKAGE}.new_unit"])
    assert registry.index() is None


def test_activation_imports_only_units_that_can_apply(tmp_path):
    """An engine built from the index on mlx-lm 0.32.2 (no mlx-vlm) imports the units that apply, no others."""
    code = textwrap.dedent(
        """
        import json, sys
        from kvpatch import registry
        from kvpatch.config import Config
        from kvpatch.detect import Upstream
        from kvpatch.engine import Engine, State
        up = {"mlx-lm": Upstream("mlx-lm", "0.32.2"), "mlx-vlm": Upstream("mlx-vlm", None)}
        engine = Engine(registry.index(), upstream=up, config=Config())
        loaded = sorted(m for m in sys.modules if m.startswith(("kvpatch.patches.mlx_lm.", "kvpatch.patches.mlx_vlm.")))
        pending = sorted(st.patch.module for st in engine.status.values() if st.state is State.PENDING)
        print(json.dumps({"loaded": loaded, "pending": pending, "broken": engine.broken}))
        """
    )
    env = {"KVPATCH": "off", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["broken"] == {}
    assert seen["pending"] and seen["loaded"] == seen["pending"]
    eager = {p.module for p in RECORDS if decide(p, Upstream("mlx-lm", "0.32.2"), Config()).action.value == "apply"}
    assert set(seen["pending"]) == eager


@pytest.mark.parametrize("stale", ["missing", "garbage"])
def test_unusable_index_file_is_not_used(monkeypatch, tmp_path, stale):
    monkeypatch.setattr(registry, "INDEX", tmp_path / "units.json")
    if stale == "garbage":
        registry.INDEX.write_text("{not json", encoding="utf-8")
    assert registry.index() is None
