"""The Verifier and the engine's lock, on a small fake upstream (one class, ``mlx_lm.models.cache.C.f``, that says
"buggy"): a hook never measures (a reproduction never runs inside an import, even in a verification process), every
state change happens under the engine's lock, and what ``status --verify`` finds names the record field to change
(or, for a patch switched off, is the user's choice)."""

from __future__ import annotations

import textwrap

from support import DEMO_PATCH, fake_upstream, run_child


def _run(code: str, tmp_path, version: str) -> dict:
    """``code`` after :data:`support.DEMO_PATCH`, over a fake mlx-lm ``version``, with verdicts of its own."""
    pythonpath = fake_upstream(tmp_path, version)
    verdicts = str(tmp_path / "verdicts")
    return run_child(DEMO_PATCH + textwrap.dedent(code), tmp_path, PYTHONPATH=pythonpath, KVPATCH="off",
                     KVPATCH_VERDICTS=verdicts)  # fmt: skip


def test_every_state_change_is_under_the_engines_lock_and_no_hook_measures(tmp_path):
    """A checking lock in the engine's place: activation (the hooks leave a patch its reproduction decides pending
    verification), the Verifier (measures, stores, installs), a vendored copy registered and patched on import,
    and deactivation change states only while the engine's lock is held; no reproduction runs inside an import."""
    out = _run(
        """
        import threading
        from kvpatch import engine as engine_module, vendored
        from kvpatch.verifier import Verifier

        class CheckingLock:
            def __init__(self):
                self.lock, self.owner, self.depth = threading.RLock(), None, 0
            def __enter__(self):
                self.lock.acquire()
                self.owner, self.depth = threading.get_ident(), self.depth + 1
                return self
            def __exit__(self, *exc):
                self.depth -= 1
                if not self.depth:
                    self.owner = None
                self.lock.release()
            def held(self):
                return self.owner == threading.get_ident()

        unlocked, changes = [], []
        def checking(self, name, value):
            if name in ("state", "why", "error") and name in self.__dict__:
                changes.append(name)
                if not ENGINE.lock.held():
                    unlocked.append((self.patch.id, name, str(value)))
            object.__setattr__(self, name, value)
        engine_module.PatchStatus.__setattr__ = checking

        ENGINE = Engine([patch("demo", ">=0.1.0,<=0.1.0", checked_through="0.1.0")], config=Config())
        ENGINE.lock = CheckingLock()
        ENGINE.activate()
        import mlx_lm.models.cache
        pending = ENGINE.status["demo"].state.value
        ran_at_import = len(INSIDE_IMPORTS)
        Verifier(ENGINE, "test").run()
        applied = ENGINE.status["demo"].state.value
        copy = vendored.register_copy(ENGINE, "copied_cache", of="mlx_lm.models.cache", version="0.1.0",
                                      patches=["demo"])[0]
        import copied_cache
        copied = copy.state.value
        vendored.restore()
        ENGINE.deactivate()
        print("@@" + json.dumps({"unlocked": unlocked, "changes": len(changes), "pending": pending,
                                 "ran_at_import": ran_at_import, "applied": applied, "copied": copied,
                                 "inside_imports": INSIDE_IMPORTS, "after": ENGINE.status["demo"].state.value}))
        """,
        tmp_path,
        "0.2.0",
    )
    assert out["unlocked"] == [] and out["changes"] >= 6, out
    assert (out["pending"], out["ran_at_import"], out["applied"]) == ("pending verification", 0, "applied"), out
    assert out["inside_imports"] == [False, False], out  # without and with the patch, both outside any import
    assert (out["copied"], out["after"]) == ("applied", "pending"), out


STATUS = """
from kvpatch.status import build_report
engine = Engine(PATCHES, config=CONFIG)
engine.activate()
report = build_report(engine, verify=True)
states = {e["id"]: e["state"] for e in report.data["patches"]}
print("@@" + json.dumps({"check": report.data["check"], "states": states}))
"""


def test_verify_names_the_record_field_a_finding_contradicts(tmp_path):
    """The bug present on a release the record says has the fix: its ``fixed_in``; absent on the release that ends
    an applied patch's range: its ``fixed_in`` too (where upstream fixed it), at the range's lower bound: ``affected``."""
    out = _run(
        textwrap.dedent(
            """
        PATCHES = [patch("fixed-here", ">=0.1.0,<0.2.0", fixed_in="0.2.0"),
                   patch("absent-at-end", ">=0.1.0,<=0.2.0", symptom="never", checked_through="0.2.0"),
                   patch("absent-at-start", ">=0.2.0,<=0.3.0", symptom="never", checked_through="0.3.0")]
        CONFIG = Config()
        """
        )
        + STATUS,
        tmp_path,
        "0.2.0",
    )
    assert out["states"] == {"fixed-here": "not needed", "absent-at-end": "applied", "absent-at-start": "applied"}
    assert out["check"] == {
        "exit": 1,
        "reasons": [
            "absent-at-end: applied, but the bug is absent upstream: update the record's fixed_in",
            "absent-at-start: applied, but the bug is absent upstream: update the record's lower bound of affected",
            "fixed-here: bug present, patch not applied (not needed): the record says otherwise; update its fixed_in",
        ],
    }, out


def test_a_disabled_patch_is_clean_whatever_verify_finds(tmp_path):
    """``KVPATCH_DISABLE``: the user's choice; ``status --verify --check`` reports the bug and exits 0."""
    out = _run(
        textwrap.dedent(
            """
        PATCHES = [patch("switched-off", ">=0.1.0,<=0.2.0", checked_through="0.2.0")]
        CONFIG = Config(disabled_ids=frozenset({"switched-off"}))
        """
        )
        + STATUS,
        tmp_path,
        "0.2.0",
    )
    assert out["states"] == {"switched-off": "disabled"}
    assert out["check"] == {"exit": 0, "reasons": []}, out
