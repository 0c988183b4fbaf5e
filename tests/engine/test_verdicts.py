"""The verdict cache (kvpatch.verdicts) and the engine's use of it, without a real upstream.

A fake ``mlx_lm`` package (one module, one class) with a ``.dist-info`` saying a release newer than the
test patch's ``checked_through`` stands in for upstream in child processes, so the gate says "the
reproduction decides"; the test patch's reproduction raises if it is ever called.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
from support import DEMO_PATCH, child_env, fake_mlx_core

from kvpatch import config, fingerprints, locate, store, surgery, verdicts, verifier
from kvpatch.detect import Source, Upstream
from kvpatch.record import Expiry, Finding, Patch


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Point the cache at ``tmp_path`` and forget what this process read or requested."""
    monkeypatch.setenv(config.VERDICTS, str(tmp_path / "cache"))
    monkeypatch.setattr(verdicts, "_loaded", None)
    monkeypatch.setattr(verifier, "_requested", None)
    monkeypatch.setattr(fingerprints, "_new", {})
    return tmp_path / "cache"


def _patch(**kw) -> Patch:
    p = Patch(
        id="demo-bug",
        summary="demo",
        distribution="mlx-lm",
        affected=">=0.1.0,<=0.2.0",
        checked_through="0.2.0",
        reference="none",
        expiry=Expiry("never"),
        **kw,
    )
    p.module = "kvpatch_demo_patch"
    return p


UPSTREAM = {"mlx-lm": Upstream("mlx-lm", "0.3.0", Source()), "mlx": Upstream("mlx", "0.1.0", Source())}


# -- the file ----------------------------------------------------------------------------------------


def test_verdict_places_follow_the_override_then_prefix_then_user(monkeypatch, tmp_path):
    monkeypatch.setenv(config.VERDICTS, str(tmp_path / "x"))
    assert [p.path for p in store.verdict_places()] == [tmp_path / "x"]
    monkeypatch.delenv(config.VERDICTS)
    monkeypatch.delenv("KVPATCH_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    prefix, user = store.verdict_places()  # kvpatch is installed under sys.prefix here (the test venv)
    assert prefix.path == Path(sys.prefix) / "var" / "cache" / "kvpatch"
    assert user.path.parent == tmp_path / "xdg" / "kvpatch" / "state"
    assert user == store.env_dir()


def test_store_then_lookup_round_trip(fresh):
    p = _patch()
    key = verdicts.key(p, UPSTREAM)
    assert verdicts.lookup(key) is None
    v = verdicts.verdict_of(Finding(True, "bad"), Finding(False, "good"), by="test")
    assert v.outcome == verdicts.Outcome.FIXED
    assert verdicts.store(key, p, v, UPSTREAM)
    found = verdicts.lookup(key)
    assert found is not None and found.outcome == verdicts.Outcome.FIXED and found.by == "test"
    data = json.loads((fresh / verdicts.FILE).read_text())
    assert data["schema"] == verdicts.SCHEMA and data["verdicts"][key]["patch"] == "demo-bug"
    assert not [f for f in os.listdir(fresh) if f.endswith(".tmp")]  # the temporary file was renamed


@pytest.mark.parametrize("content", [b"{not json", b"[]", b'{"schema": "other/1", "verdicts": {}}', b"\xff\xfe", b""])
def test_corrupt_or_foreign_file_reads_as_empty(fresh, content):
    fresh.mkdir(parents=True)
    (fresh / verdicts.FILE).write_bytes(content)
    assert verdicts.lookup("anything") is None
    # and a later store replaces it with a good file
    p = _patch()
    assert verdicts.store("k", p, verdicts.Verdict(verdicts.Outcome.ABSENT, "", time.time()), UPSTREAM)
    verdicts._loaded = None  # read the file afresh
    assert verdicts.lookup("k").outcome == verdicts.Outcome.ABSENT


def test_sizes_are_kept_with_the_verdict_and_a_malformed_entry_has_none(fresh):
    p = _patch()
    before = Finding(True, "rows differ", error=0.1, rounding=4.8e-7)
    after = Finding(False, "rows equal", error=0.0, rounding=4.8e-7)
    verdict = verdicts.verdict_of(before, after)
    sides = {"without": before, "with": after}
    assert verdict.sizes == {side: {"error": f.error, "rounding": f.rounding} for side, f in sides.items()}
    assert verdicts.store("k", p, verdict, UPSTREAM)
    verdicts._loaded = None  # read the file afresh
    assert verdicts.lookup("k").sizes == verdict.sizes
    assert verdicts.margin(verdict.sizes).startswith("without the patch 0.1 = 2.08e+05x the rounding (4.8e-07)")
    assert verdicts.sizes_of(Finding(True, "raises ValueError"), after) == {"with": verdict.sizes["with"]}
    assert verdicts.sizes_of(Finding(True, "raises"), None) is None and verdicts.margin(None) is None
    data = json.loads((fresh / verdicts.FILE).read_text())
    data["verdicts"]["k"]["sizes"] = {"without": {"error": "big", "rounding": 0}, "other": 1}
    (fresh / verdicts.FILE).write_text(json.dumps(data))
    verdicts._loaded = None
    found = verdicts.lookup("k")
    assert found is not None and found.outcome is verdicts.Outcome.FIXED and found.sizes is None


def test_entries_are_pruned_oldest_first(fresh, monkeypatch):
    monkeypatch.setattr(verdicts, "MAX_ENTRIES", 3)
    p = _patch()
    for i in range(5):
        verdicts.store(f"k{i}", p, verdicts.Verdict(verdicts.Outcome.ABSENT, "", float(i + 1)), UPSTREAM)
    verdicts._loaded = None  # read the file afresh
    assert [verdicts.lookup(f"k{i}") is not None for i in range(5)] == [False, False, True, True, True]


def test_key_depends_on_versions_sources_and_target_files(fresh, tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "mlx_lm"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("")
    target = pkg / "models" / "cache.py"
    target.write_text("class C:\n    def f(self):\n        return 1\n")
    monkeypatch.setitem(sys.modules, "mlx_lm", types.SimpleNamespace(__file__=str(pkg / "__init__.py")))
    for imported in ("mlx_lm.models", "mlx_lm.models.cache"):  # a real mlx-lm imported earlier in this process
        monkeypatch.delitem(sys.modules, imported, raising=False)
    p = _patch()
    p.replace("mlx_lm.models.cache", "C.f")(lambda original: original)
    base = verdicts.key(p, UPSTREAM)
    assert locate.module_file("mlx_lm.models.cache") == str(target)
    assert verdicts.key(p, UPSTREAM) == base  # stable
    editable = {**UPSTREAM, "mlx-lm": Upstream("mlx-lm", "0.3.0", Source(kind="editable", url="file:///src"))}
    assert verdicts.key(p, editable) != base
    newer = {**UPSTREAM, "mlx-lm": Upstream("mlx-lm", "0.3.1", Source())}
    assert verdicts.key(p, newer) != base
    other_mlx = {**UPSTREAM, "mlx": Upstream("mlx", "0.1.1", Source())}
    assert verdicts.key(p, other_mlx) != base
    target.write_text("class C:\n    def f(self):\n        return 2  # edited in place\n")
    assert verdicts.key(p, UPSTREAM) != base


@pytest.mark.parametrize(
    ("before", "after", "outcome"),
    [
        (Finding(False, "fine"), None, verdicts.Outcome.ABSENT),
        (Finding(True, "bad"), Finding(False, "good"), verdicts.Outcome.FIXED),
        (Finding(True, "bad"), Finding(True, "still"), verdicts.Outcome.NOT_FIXED),
        (Finding(False, inconclusive="RuntimeError: x"), None, verdicts.Outcome.INCONCLUSIVE),
        (Finding(True, "bad"), Finding(False, inconclusive="RuntimeError: y"), verdicts.Outcome.INCONCLUSIVE),
        (Finding(False, skipped="Metal only"), None, verdicts.Outcome.SKIPPED),
        (Finding(True, "bad"), None, verdicts.Outcome.INCONCLUSIVE),
    ],
)
def test_from_findings(before, after, outcome):
    assert verdicts.verdict_of(before, after).outcome == outcome


def test_no_background_verification_when_switched_off_or_inside_one(fresh, monkeypatch):
    monkeypatch.setenv(config.VERIFY, "never")
    text = verifier.request_verification(["k"])
    assert "KVPATCH_VERIFY=never" in text and "kvpatch verify" in text
    monkeypatch.setattr(verifier, "_requested", None)
    monkeypatch.delenv(config.VERIFY)
    monkeypatch.setenv(config.VERIFYING, "1")  # as Verifier.begin() says of its process
    assert "verification process" in verifier.request_verification(["k"])


def test_a_recent_attempt_is_not_repeated(fresh, monkeypatch):
    monkeypatch.setenv(config.VERIFY, "auto")
    verdicts.update(
        lambda data: data["attempts"].update({"k": {"at": time.time(), "pid": 1}})
    )  # as the background verifier does
    verdicts._loaded = None  # read the file afresh
    text = verifier.request_verification(["k"])
    assert "has not settled it" in text, text


def test_foreign_targets_name_what_sits_on_a_target(monkeypatch):
    def upstream_f(self):
        return 1

    upstream_f.__module__ = "mlx_lm.models.fake"

    def server_f(self):
        return 2

    server_f.__module__ = "some_server.patches"
    server_f.__qualname__ = "server_f"
    cls = type("C", (), {"f": upstream_f, "g": server_f})
    module = types.ModuleType("mlx_lm.models.fake")
    module.C = cls  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mlx_lm.models.fake", module)
    p = _patch()
    p.replace("mlx_lm.models.fake", "C.f")(lambda o: o)
    p.replace("mlx_lm.models.fake", "C.g")(lambda o: o)
    assert surgery.foreign_targets(p) == ["mlx_lm.models.fake.C.g: some_server.patches.server_f"]


# -- the engine, in a child process with a fake upstream -------------------------------------------------


FAKE_CACHE = "class C:\n    def f(self):\n        return 'buggy'\n"


@pytest.fixture
def fake_site(tmp_path):
    site = tmp_path / "site"
    pkg = site / "mlx_lm"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "models" / "cache.py").write_text(FAKE_CACHE)
    fake_mlx_core(site)
    info = site / "mlx_lm-0.3.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mlx-lm\nVersion: 0.3.0\n")
    return site


CHILD = DEMO_PATCH + textwrap.dedent(
    """
    from kvpatch import fingerprints, verdicts
    from kvpatch.engine import REPRODUCTIONS_RUN
    from kvpatch.verifier import Verifier
    mode = sys.argv[1]
    p = patch("demo-bug", ">=0.1.0,<=0.2.0", checked_through="0.2.0")
    if len(sys.argv) > 2 and sys.argv[2]:  # the fingerprints the patch was validated on (shipped data)
        fingerprints.shipped()["demo-bug"] = {"mlx_lm.models.cache.C.f": frozenset(sys.argv[2].split(","))}

    if mode == "measure-raising":  # a reproduction that hits an error which is not the bug's symptom
        p.reproduction = lambda: (_ for _ in ()).throw(RuntimeError("no kernel for this shape"))
    engine = Engine([p], config=Config())
    key = verdicts.key(p, engine.upstream)
    if not mode.startswith(("none", "measure")):
        verdicts.store(key, p, verdicts.Verdict(verdicts.Outcome(mode), "stored by the test", 1.0, "test"), engine.upstream)
    engine.activate()
    import mlx_lm.models.cache as c
    if mode.startswith("measure"):  # a verification process: measures and stores the verdict
        Verifier(engine, "test", remeasure=False).run()
    st = engine.status["demo-bug"]
    from kvpatch.status import build_report
    check = build_report(engine).data["check"]
    print("@@" + json.dumps({"state": st.state.value, "reason": st.reason, "f": c.C().f(), "drift": st.drift,
                             "reproductions": REPRODUCTIONS_RUN, "action": st.decision.action.value,
                             "stored": (setattr(verdicts, '_loaded', None), verdicts.lookup(key))[1] is not None, "check": check}))
    """
)


def _child(fake_site, tmp_path, *args: str, **env: str) -> dict:
    environ = child_env(
        {
            "PYTHONPATH": os.pathsep.join([str(fake_site), os.environ.get("PYTHONPATH", "")]),
            config.VERDICTS: str(tmp_path / "cache"),
            config.VERIFY: "never",
            "KVPATCH": "off",  # the .pth bootstrap stays out; the child builds its own engine
            **env,
        }
    )
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *args], env=environ, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("@@"))[2:])


@pytest.mark.parametrize(
    ("stored", "state", "f"),
    [
        ("none", "pending verification", "buggy"),
        (verdicts.Outcome.FIXED.value, "applied", "fixed"),
        (verdicts.Outcome.ABSENT.value, "not needed", "buggy"),
        (verdicts.Outcome.NOT_FIXED.value, "drifted", "buggy"),
        (verdicts.Outcome.INCONCLUSIVE.value, "inconclusive", "buggy"),
    ],
)
def test_engine_reads_the_verdict_and_never_reproduces(fake_site, tmp_path, stored, state, f):
    out = _child(fake_site, tmp_path, stored)
    assert out["action"] == "verify", out
    assert out["reproductions"] == [], out
    assert (out["state"], out["f"]) == (state, f), out
    if stored == "none":
        assert "no verdict" in out["reason"] and "kvpatch verify" in out["reason"], out["reason"]


def test_drifted_target_goes_to_its_verdict(fake_site, tmp_path):
    # an in-range release (APPLY), but the target's fingerprint is none of those recorded: no verdict, not applied
    info = fake_site / "mlx_lm-0.3.0.dist-info" / "METADATA"
    info.write_text(info.read_text().replace("0.3.0", "0.2.0"))
    out = _child(fake_site, tmp_path, "none", "000000000000")
    assert out["action"] == "apply"
    assert out["drift"] and out["state"] == "pending verification" and out["f"] == "buggy", out
    assert out["reproductions"] == []
    # with its true fingerprint recorded it applies, reading no verdict
    from kvpatch.fingerprints import fingerprint

    namespace: dict = {}
    exec(compile(FAKE_CACHE, str(fake_site / "mlx_lm" / "models" / "cache.py"), "exec"), namespace)
    true = fingerprint(namespace["C"].f)
    out = _child(fake_site, tmp_path, "none", true)
    assert (out["state"], out["f"], out["drift"]) == ("applied", "fixed", []), out
    # and the fingerprint is cached by the file's stat for the next process
    data = json.loads((tmp_path / "cache" / verdicts.FILE).read_text())
    assert any(true in entry.values() for entry in data["fingerprints"].values()), data["fingerprints"]


@pytest.mark.parametrize(
    ("mode", "state", "f"), [("measure", "applied", "fixed"), ("measure-raising", "inconclusive", "buggy")]
)
def test_a_verification_process_measures_and_stores(fake_site, tmp_path, mode, state, f):
    """Only a verification process runs the reproduction; an error that is not the bug's symptom gives an
    inconclusive verdict: not applied, and ``status --check`` fails on it without advising a record edit."""
    out = _child(fake_site, tmp_path, mode)
    assert (out["state"], out["f"]) == (state, f), out
    assert out["reproductions"] == (["demo-bug", "demo-bug"] if state == "applied" else ["demo-bug"]), out
    assert out["stored"], out
    if state == "inconclusive":
        assert "no kernel for this shape" in out["reason"], out
        assert out["check"]["exit"] == 1, out["check"]
        text = " ".join(out["check"]["reasons"])
        assert "inconclusive" in text and "not a record error" in text and "update" not in text, text
    # and a later user process reads it without reproducing
    later = _child(fake_site, tmp_path, "none")
    assert (later["state"], later["reproductions"]) == (state, []), later
