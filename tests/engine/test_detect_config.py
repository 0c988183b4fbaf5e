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
    assert up.version == "0.5.0" and up.source.kind == "vcs" and up.source.commit.startswith("6f60ee44")


def test_detect_one_corrupt_direct_url(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(_fake_dist(tmp_path, "kvpatch-probe-dist2", "1.0", "{{{")))
    up = detect_one("kvpatch-probe-dist2")
    assert up.version == "1.0" and up.source.kind == "unknown"


def test_detect_missing():
    up = detect_one("kvpatch-no-such-distribution")
    assert up.installed is False and up.version is None and up.version_unknown is None
    assert up.source.kind == "none", "an absent distribution has no install source (never 'index')"


# (METADATA bytes or None for no file, what version_unknown must say)
BROKEN_METADATA = [
    (None, "METADATA missing"),
    (b"", "METADATA empty"),
    (b"  \n", "METADATA empty"),
    (b"Metadata-Version: 2.1\nName: kvpatch-probe-broken\nSummary: caf\xe9\nVersion: 1.0\n", "METADATA unreadable"),
    (b"Metadata-Version: 2.1\nName: kvpatch-probe-broken\n", "METADATA has no Version"),
]


def _broken_dist(root, metadata: bytes | None, *, package: bool = True, dist_info: bool = True):
    if package:
        (root / "kvpatch_probe_broken").mkdir()
        (root / "kvpatch_probe_broken" / "__init__.py").write_text(
            "raise RuntimeError('detection must not import me')\n"
        )
    if dist_info:
        info = root / "kvpatch_probe_broken-1.0.dist-info"
        info.mkdir()
        if metadata is not None:
            (info / "METADATA").write_bytes(metadata)
    return root


@pytest.mark.parametrize(
    ("metadata", "why"), BROKEN_METADATA, ids=["missing", "empty", "blank", "non-utf8", "no-version"]
)
def test_importable_without_readable_version_is_installed_version_unknown(tmp_path, monkeypatch, metadata, why):
    monkeypatch.syspath_prepend(str(_broken_dist(tmp_path, metadata)))
    up = detect_one("kvpatch-probe-broken")
    assert up.installed and up.version is None
    assert up.version_unknown.startswith(why), up.version_unknown
    assert "kvpatch_probe_broken" not in sys.modules, "detection imported the package"


def test_importable_without_any_dist_info_is_installed_version_unknown(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(_broken_dist(tmp_path, None, dist_info=False)))
    up = detect_one("kvpatch-probe-broken")
    assert up.installed and up.version is None and "no .dist-info" in up.version_unknown
    assert up.source.kind == "unknown"


def test_leftover_dist_info_without_package_is_not_installed(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(_broken_dist(tmp_path, b"", package=False)))
    up = detect_one("kvpatch-probe-broken")
    assert not up.installed and up.source.kind == "none"


def test_a_bare_namespace_directory_is_not_a_package(tmp_path, monkeypatch):
    (tmp_path / "kvpatch_probe_broken").mkdir()  # no __init__.py: a namespace portion, not a package
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not detect_one("kvpatch-probe-broken").installed


def test_presence_check_does_not_consult_meta_path(tmp_path, monkeypatch):
    """kvpatch's bootstrap finder (or any finder on sys.meta_path) is never asked during detection."""
    asked = []

    class Spy:
        @staticmethod
        def find_spec(name, path=None, target=None):
            asked.append(name)
            return None

    monkeypatch.syspath_prepend(str(_broken_dist(tmp_path, None)))
    monkeypatch.setattr(sys, "meta_path", [Spy, *sys.meta_path])
    assert detect_one("kvpatch-probe-broken").installed
    assert asked == []


CONFIGS = [
    ({}, True, set(), False, False, 0),
    ({"KVPATCH": "off"}, False, set(), False, False, 0),
    ({"KVPATCH": "0"}, False, set(), False, False, 0),
    ({"KVPATCH": "On"}, True, set(), False, False, 0),
    ({"KVPATCH": "banana"}, True, set(), False, False, 1),
    ({"KVPATCH_DISABLE": "a, b ,,"}, True, {"a", "b"}, False, False, 0),
    ({"KVPATCH_DISABLE": "*"}, True, set(), True, False, 0),
    ({"KVPATCH_DISABLE": "nope"}, True, set(), False, False, 1),
    ({"KVPATCH_DISABLE": "x1,x2,x3,x4,x5,a"}, True, {"a"}, False, False, 1),  # one message for all of them
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


KNOWN = frozenset({"mask-fill", "offset-detach", "offset-detach-vlm", "max-kv-size-ignored"})


@pytest.mark.parametrize("variable", ["KVPATCH_DISABLE", "KVPATCH_ENABLE"])
def test_unknown_id_suggests_the_close_match(variable):
    [problem] = read_config({variable: "mask-fil"}, known_ids=KNOWN).problems
    assert "'mask-fil'" in problem and "did you mean 'mask-fill'?" in problem
    assert "offset-detach" not in problem, "the known ids are not listed"


def test_unknown_id_without_a_close_match_gets_no_suggestion():
    [problem] = read_config({"KVPATCH_DISABLE": "zzz"}, known_ids=KNOWN).problems
    assert "'zzz'" in problem and "did you mean" not in problem


def test_many_unknown_ids_make_one_short_message():
    value = ",".join(f"nope-{i}" for i in range(1000))
    [problem] = read_config({"KVPATCH_DISABLE": value}, known_ids=KNOWN).problems
    assert "and 997 more" in problem and len(problem) < 300


@pytest.mark.parametrize("variable", ["KVPATCH", "KVPATCH_ENFORCE", "KVPATCH_DISABLE", "KVPATCH_ENABLE"])
def test_long_values_are_never_echoed_in_full(variable):
    value = "x" * 100_000
    [problem] = read_config({variable: value}, known_ids=KNOWN).problems
    assert len(problem) < 400, len(problem)
    assert "100000 characters" in problem


_STATUS_IMPORTS = (
    "import sys, kvpatch\n"
    "from kvpatch.status import build_report\n"
    "build_report(kvpatch.get_engine(){args})\n"
    "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'mlx_vlm')))"
)


def test_status_without_settling_does_not_import_mlx(run_py, tmp_path):
    """``status --no-settle`` reads package metadata only, whatever the install source and cache."""
    out = run_py(_STATUS_IMPORTS.format(args=", settle=False"), env={"KVPATCH_CACHE": str(tmp_path / "cache")})
    assert out.strip() == "[]"


def test_settled_status_is_reused_without_importing_mlx(run_py, tmp_path):
    """``status`` settles outcomes by importing what an import would patch (README, "What status says"), once
    per environment: the next ``status`` reads the cached outcome and imports nothing of upstream. (The first
    may import upstream where it is installed: that is the settling, so it is not asserted on.)"""
    env = {"KVPATCH_CACHE": str(tmp_path / "cache")}
    run_py(_STATUS_IMPORTS.format(args=""), env=env)
    assert run_py(_STATUS_IMPORTS.format(args=""), env=env).strip() == "[]"


def test_garbage_environment_never_crashes(run_py):
    out = run_py(
        "import warnings\nwarnings.simplefilter('always')\nimport kvpatch\nprint('imported', kvpatch.get_engine().config.problems)",
        env={"KVPATCH": "\x7fweird", "KVPATCH_DISABLE": ",,*,??", "KVPATCH_ENFORCE": "maybe"},
    )
    assert "imported" in out


def test_python_version():
    assert sys.version_info >= (3, 10)
