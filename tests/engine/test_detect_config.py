"""Install-source detection (PEP 610) and environment-variable parsing."""

from __future__ import annotations

import json
import sys

import pytest

from kvpatch.config import read_config
from kvpatch.detect import detect_one, read_source

SOURCES = [
    (None, "index", None),
    (
        '{"url": "https://github.com/Blaizzy/mlx-vlm", "vcs_info": {"vcs": "git", "commit_id": "F96138EE0000000000000000000000000000dead"}}',
        "vcs",
        "f96138ee0000000000000000000000000000dead",
    ),
    ('{"url": "https://github.com/x/y", "vcs_info": {"vcs": "git", "requested_revision": "main"}}', "vcs", None),
    ('{"url": "file:///src/mlx-lm", "dir_info": {"editable": true}}', "editable", None),
    ('{"url": "file:///src/mlx-lm", "dir_info": {}}', "directory", None),
    ('{"url": "file:///x.tar.gz", "archive_info": {"hash": "sha256=00"}}', "archive", None),
    ("{not json", "unknown", None),
    ("[]", "unknown", None),
    ('{"url": "x"}', "unknown", None),
    ('{"url": "x", "vcs_info": {"commit_id": "not-hex!"}}', "unknown", None),
]


@pytest.mark.parametrize(("text", "kind", "commit"), SOURCES)
def test_read_source(text, kind, commit):
    src = read_source(text)
    assert src.kind == kind
    assert src.commit == commit
    if kind == "unknown":
        assert src.error


def _fake_dist(tmp_path, name, version, direct_url=None):
    info = tmp_path / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if direct_url is not None:
        (info / "direct_url.json").write_text(direct_url)
    return tmp_path


def test_detect_one_reads_dist_info(tmp_path, monkeypatch):
    url = json.dumps(
        {"url": "https://github.com/Blaizzy/mlx-vlm", "vcs_info": {"vcs": "git", "commit_id": "6f60ee44" + "0" * 32}}
    )
    monkeypatch.syspath_prepend(str(_fake_dist(tmp_path, "kvpatch-probe-dist", "0.5.0", url)))
    up = detect_one("kvpatch-probe-dist")
    assert up.version == "0.5.0" and up.source.kind == "vcs" and up.commit.startswith("6f60ee44")


def test_detect_one_corrupt_direct_url(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(_fake_dist(tmp_path, "kvpatch-probe-dist2", "1.0", "{{{")))
    up = detect_one("kvpatch-probe-dist2")
    assert up.version == "1.0" and up.source.kind == "unknown"


def test_detect_missing():
    assert detect_one("kvpatch-no-such-distribution").installed is False


CONFIGS = [
    ({}, True, set(), False, False, 0),
    ({"KVPATCH": "off"}, False, set(), False, False, 0),
    ({"KVPATCH": "0"}, False, set(), False, False, 0),
    ({"KVPATCH": "On"}, True, set(), False, False, 0),
    ({"KVPATCH": "banana"}, True, set(), False, False, 1),
    ({"KVPATCH_DISABLE": "a, b ,,"}, True, {"a", "b"}, False, False, 0),
    ({"KVPATCH_DISABLE": "*"}, True, set(), True, False, 0),
    ({"KVPATCH_DISABLE": "nope"}, True, set(), False, False, 1),
    ({"KVPATCH_ENFORCE": "1"}, True, set(), False, True, 0),
    ({"KVPATCH_ENFORCE": "0"}, True, set(), False, False, 0),
    ({"KVPATCH_ENFORCE": "???"}, True, set(), False, False, 1),
]


@pytest.mark.parametrize(("env", "enabled", "ids", "all_", "enforce", "n_problems"), CONFIGS)
def test_read_config(env, enabled, ids, all_, enforce, n_problems):
    cfg = read_config(env, known_ids=frozenset({"a", "b"}))
    assert cfg.enabled is enabled
    assert cfg.disabled_ids == ids
    assert cfg.disable_all is all_
    assert cfg.enforce is enforce
    assert len(cfg.problems) == n_problems


def test_status_does_not_import_mlx(run_py):
    out = run_py(
        "import sys, kvpatch\n"
        "from kvpatch.status import build_report\n"
        "build_report(kvpatch.get_engine())\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'mlx_vlm')))"
    )
    assert out.strip() == "[]"


def test_garbage_environment_never_crashes(run_py):
    out = run_py(
        "import warnings\nwarnings.simplefilter('always')\nimport kvpatch\nprint('imported', kvpatch.get_engine().config.problems)",
        env={"KVPATCH": "\x7fweird", "KVPATCH_DISABLE": ",,*,??", "KVPATCH_ENFORCE": "maybe"},
    )
    assert "imported" in out


def test_python_version():
    assert sys.version_info >= (3, 10)
