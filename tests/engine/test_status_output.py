"""What ``kvpatch status`` prints: the compact default view, ``-v``, and ``--json`` against the published
JSON Schema (``kvpatch/data/status.schema.json``, shipped in the wheel)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
from schema_lite import unsupported, validate
from support import child_env, synthetic_patch

from kvpatch import registry
from kvpatch.config import Config, read_config
from kvpatch.detect import NOT_INSTALLED, Source, Upstream
from kvpatch.engine import Engine, sharing
from kvpatch.status import build_report, format_text
from kvpatch.verdicts import Outcome

PATCHES = registry.load().patches
NEWEST = {
    "mlx": Upstream("mlx", "0.32.4"),
    "mlx-lm": Upstream("mlx-lm", "0.32.2"),
    "mlx-vlm": Upstream("mlx-vlm", "0.7.10"),
}
NOTHING = {name: Upstream(name, None, NOT_INSTALLED) for name in ("mlx", "mlx-lm", "mlx-vlm")}
#: A terminal's height: the compact view of the newest releases stays within it (43 lines with every patch that
#: applies there; the patches the bug hunt added brought it from 40).
ONE_SCREEN = 45


def _schema() -> dict:
    return json.loads(resources.files("kvpatch").joinpath("data/status.schema.json").read_text())


def _report(upstream, config=None):
    return build_report(Engine(PATCHES, upstream=upstream, config=config or Config()))


def _ids_shown(text: str) -> set[str]:
    ids = {p.id for p in PATCHES}
    return {word for line in text.splitlines() for word in line.split()[:1] if word in ids}


# -- the compact default view ---------------------------------------------------------------------------


def test_newest_releases_fit_one_screen_and_show_only_what_is_active():
    report = _report(NEWEST)
    text = format_text(report)
    lines = text.splitlines()
    assert len(lines) <= ONE_SCREEN, text
    active = {p["id"] for p in report.data["patches"] if p["state"] not in ("not needed", "out of range")}
    assert active, "some patch applies to the newest releases"
    assert _ids_shown(text) == active, text
    assert lines[1] == "upstream: mlx 0.32.4, mlx-lm 0.32.2, mlx-vlm 0.7.10"
    assert lines[2].startswith(f"{len(PATCHES)} patches: ") and "not needed" in lines[2]
    assert max(len(line) for line in format_text(report, width=100).splitlines()) <= 100


def test_verbose_lists_every_patch_with_target_and_reason():
    text = format_text(_report(NEWEST), verbose=True)
    assert _ids_shown(text) == {p.id for p in PATCHES}
    for label in ("affected:  ", "fixed in:  ", "target:    ", "why:       ", "reference: "):
        assert text.count(f"\n    {label}") == len(PATCHES), label


def test_verbose_shows_the_margin_of_a_measured_verdict():
    report = _report(NEWEST)
    pid = report.data["patches"][0]["id"]
    margin = "without the patch 0.1 = 2.1e+05x the rounding (4.8e-07); with it 0 = 0x the rounding (4.8e-07)"
    text = format_text(report._replace(margins={pid: margin}), verbose=True, width=200)
    assert f"    margin:    {margin}" in text.splitlines()
    assert "margin:" not in format_text(report, verbose=True, width=200)
    assert "margin" not in json.dumps(report.data)  # the text's, not the JSON's (kvpatch.status/1 unchanged)


@pytest.mark.parametrize("width", [60, 80, 132])
def test_verbose_wraps_to_the_width(width):
    """``status -v`` ran to 238 characters a line; every line now fits, but a single word longer than the
    line (a URL, a dotted target) is kept whole rather than broken."""
    report = _report(NEWEST)
    text = format_text(report, verbose=True, width=width)
    too_long = [line for line in text.splitlines() if len(line) > width and len(line.split()) > 2]
    assert not too_long, too_long
    assert max(len(line) for line in format_text(report, verbose=True).splitlines()) <= 80 + 40  # default: 80
    # every reason is there in full, only wrapped
    flat = " ".join(text.split())
    assert all(" ".join(e["reason"].split()) in flat for e in report.data["patches"])


def test_not_installed_count_names_the_package():
    """ "50 patches: 25 not installed" read as "25 failed to install": it says whose package is absent."""
    upstream = dict(NEWEST)
    upstream["mlx-vlm"] = NOTHING["mlx-vlm"]
    report = _report(upstream)
    header = format_text(report).splitlines()[2]
    vlm = sum(1 for p in PATCHES if p.distribution == "mlx-vlm")
    assert header.startswith(f"{len(PATCHES)} patches: ") and header.endswith(f", {vlm} for mlx-vlm (not installed)")
    assert "0 not installed" not in header and ": 25 not installed" not in header


def test_check_line_names_an_exit_status_only_when_asked():
    report = _report(NEWEST)
    assert report.data["check"]["exit"] == 0
    assert format_text(report).splitlines()[-2] == "check: clean, nothing needs attention"
    assert format_text(report, check=True).splitlines()[-2] == "check: clean (exit 0)"
    config = read_config({"KVPATCH_DISABLE": "*"}, known_ids=frozenset(p.id for p in PATCHES))
    attention = _report(NEWEST, config)
    if attention.data["check"]["reasons"]:
        code = attention.data["check"]["exit"]
        assert f"(`kvpatch status --check` exits {code}):" in format_text(attention)
        assert f"(exit {code}):" in format_text(attention, check=True)


def test_skipped_reproductions_are_named():
    """ "verified: ...; 1 skipped" did not say which patch's check was skipped."""
    report = _report(NEWEST)
    entries = report.data["patches"]
    entries[0]["verify"] = {"outcome": "skipped: Metal only"}
    entries[1]["verify"] = {"outcome": "bug present, fixed by patch"}
    report.outcomes.update({entries[0]["id"]: Outcome.SKIPPED, entries[1]["id"]: Outcome.FIXED})
    line = next(line for line in format_text(report).splitlines() if line.startswith("verified: "))
    assert f"1 skipped ({entries[0]['id']}: `kvpatch status -v` says why)" in line, line
    assert entries[1]["id"] not in line


@pytest.mark.parametrize("verbose", [False, True])
def test_not_installed_is_one_line_per_distribution_not_one_per_patch(verbose):
    text = format_text(_report(NOTHING), verbose=verbose)
    assert len(text.splitlines()) <= 12, text
    assert "upstream: mlx not installed, mlx-lm not installed, mlx-vlm not installed" in text
    assert not _ids_shown(text)
    if verbose:
        assert "mlx-lm not installed: its" in text and "mlx-vlm not installed: its" in text
    else:
        assert "nothing to patch here: neither mlx-lm nor mlx-vlm is installed" in text
    assert "for mlx-lm (not installed)" in text.splitlines()[2]


def test_attention_comes_first_and_disabled_is_one_line():
    config = read_config(
        {"KVPATCH_DISABLE": "offset-detach,rotating-merge-empty"}, known_ids=frozenset(p.id for p in PATCHES)
    )
    text = format_text(_report(NEWEST, config))
    disabled = [line for line in text.splitlines() if "offset-detach, rotating-merge-empty" in line]
    assert len(disabled) == 1, text
    assert text.index("disabled (2):") < text.index("will apply when its module is imported")


def test_version_unknown_and_sources_are_spelled_out():
    upstream = dict(NEWEST)
    upstream["mlx-lm"] = Upstream("mlx-lm", None, Source(), version_unknown="METADATA empty")
    upstream["mlx-vlm"] = Upstream(
        "mlx-vlm",
        "0.5.0",
        Source(kind="vcs", url="https://github.com/Blaizzy/mlx-vlm", commit="f96138ee" * 5),
    )
    text = format_text(_report(upstream))
    assert "upstream: mlx 0.32.4, mlx-lm (version unknown), mlx-vlm 0.5.0" in text
    assert "  mlx-lm: installed, version unknown (METADATA empty): the reproduction decides" in text
    assert "  mlx-vlm: vcs install https://github.com/Blaizzy/mlx-vlm@f96138eef961" in text
    assert "pending verification: the reproduction decides" in text


def test_off_says_so_in_the_first_line():
    text = format_text(_report(NEWEST, Config(enabled=False)))
    assert "OFF (KVPATCH=off)" in text.splitlines()[0]


# -- JSON and its schema ---------------------------------------------------------------------------------


def test_schema_uses_only_what_the_validator_checks():
    assert unsupported(_schema()) == []


def test_schema_is_shipped_with_the_package():
    assert resources.files("kvpatch").joinpath("data/status.schema.json").is_file()


@pytest.mark.parametrize(
    "upstream",
    [
        NEWEST,
        NOTHING,
        {
            **NEWEST,
            "mlx-lm": Upstream("mlx-lm", None, Source(kind="unknown", error="x"), version_unknown="METADATA missing"),
        },
        {**NEWEST, "mlx-vlm": Upstream("mlx-vlm", "0.5.0", Source(kind="editable", url="file:///src"))},
    ],
    ids=["newest", "nothing", "version-unknown", "editable"],
)
@pytest.mark.filterwarnings("ignore::kvpatch.KvpatchWarning")  # the unknown id below is warned about
def test_report_validates_against_the_schema(upstream):
    data = _report(
        upstream, read_config({"KVPATCH_DISABLE": "mask-fil"}, known_ids=frozenset(p.id for p in PATCHES))
    ).data
    assert validate(data, _schema()) == []
    # round-trips through JSON unchanged (no tuples, dates or enums left in it)
    assert json.loads(json.dumps(data)) == data


def test_real_cli_output_validates_against_the_schema(tmp_path):
    script = Path(sys.executable).parent / "kvpatch"
    proc = subprocess.run(
        [str(script), "status", "--json"], cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert validate(data, _schema()) == []
    for name, up in data["upstream"].items():
        if not up["installed"]:
            assert up["source"]["kind"] == "none", (name, up)


def test_validator_catches_violations():
    schema = _schema()
    data = _report(NEWEST).data
    broken = json.loads(json.dumps(data))
    broken["check"]["exit"] = 70
    del broken["patches"][0]["state"]
    broken["upstream"]["mlx-lm"]["source"]["kind"] = "pypi"
    errors = validate(broken, schema)
    assert any("check.exit" in e for e in errors)
    assert any("missing required key 'state'" in e for e in errors)
    assert any("source.kind" in e for e in errors)


def test_verify_without_run_keeps_enablers_of_the_same_target():
    """``status --verify`` takes every kvpatch patch on a target out for a patch's "without" run, except the
    enablers (qsdpa-cuda-shapes: without it CUDA has no kernel, and the reproduction could not run at all),
    which only their own verify takes out."""
    from kvpatch.record import Target

    target = Target("mlx_lm.models.base", "quantized_scaled_dot_product_attention")

    def make(pid: str, enabler: bool):
        return synthetic_patch(
            pid,
            affected=">=0.22.0,<=0.32.2",
            fixed_in=None,
            checked="0.32.2",
            target=(target.module, target.qualname),
            enabler=enabler,
        )

    fix, route, other = make("fix", False), make("route", True), make("other", False)
    engine = Engine([fix, route, other], upstream={"mlx-lm": Upstream("mlx-lm", "0.32.2")}, config=Config())
    for p in (fix, route, other):
        engine.status[p.id].installed = [target]
    assert set(sharing(engine, fix)) == {"fix", "other"}
    assert set(sharing(engine, route)) == {"fix", "route", "other"}
