"""The package's metadata as installed (pip built the wheel from this checkout): licence file, project URLs,
classifiers, extras that pick one mlx backend each, and the test requirements as a dependency group."""

from __future__ import annotations

import importlib.metadata
import re

import pytest
from support import REPO

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")

METADATA = importlib.metadata.metadata("kvpatch")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_license_file_is_in_the_repository_and_the_wheel():
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("MIT License\n\nCopyright (c) 2026 the kvpatch developers\n")
    assert METADATA["License-Expression"] == "MIT"
    assert METADATA.get_all("License-File") == ["LICENSE"]
    files = [str(f) for f in importlib.metadata.files("kvpatch") or []]
    assert any(re.fullmatch(r"kvpatch-[^/]+\.dist-info/licenses/LICENSE", f) for f in files), files
    assert "LICENSE" in PYPROJECT["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]


def test_the_units_ship_once_inside_the_package():
    """The wheel ships the units as ``kvpatch.patches`` (the ``kvpatch`` package, nothing mapped in beside it):
    every file once, and no top-level ``patches`` to shadow another project's."""
    files = [str(f) for f in importlib.metadata.files("kvpatch") or []]
    units = [f for f in files if f.startswith("kvpatch/patches/") and f.endswith(".py")]
    assert len(units) == len(set(units)), sorted(f for f in units if units.count(f) > 1)
    assert "kvpatch/patches/mlx_lm/mask_fill.py" in units and "kvpatch/patches/mlx_vlm/offset_detach.py" in units
    assert not [f for f in files if f.split("/")[0] == "patches"]
    wheel = PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert wheel["packages"] == ["kvpatch"]
    assert not [k for k, v in wheel.get("force-include", {}).items() if "patches" in k or "patches" in v]


def test_project_urls_and_classifiers():
    urls = dict(entry.split(", ", 1) for entry in METADATA.get_all("Project-URL"))
    assert set(urls) == {"Homepage", "Source", "Issues", "Changelog", "Documentation"}
    assert all(url.startswith("https://github.com/kvpatch/kvpatch") for url in urls.values())
    classifiers = METADATA.get_all("Classifier")
    for prefix in (
        "Development Status :: ",
        "Intended Audience :: ",
        "Topic :: ",
        "Programming Language :: Python :: 3.",
    ):
        assert any(c.startswith(prefix) for c in classifiers), prefix
    assert not any(c.startswith("License :: ") for c in classifiers)  # the licence expression says it (PEP 639)


def test_each_extra_picks_one_mlx_backend():
    """``lm`` / ``upstream`` pulled ``mlx[cpu]`` on CUDA hosts too: every extra that installs upstream now comes
    with exactly one backend, CPU or CUDA."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    backends = {"cpu": "mlx[cpu]", "cuda": "mlx[cuda13]"}
    for name, requirements in extras.items():
        text = " ".join(requirements)
        picked = {b for b, req in backends.items() if req in text or f"kvpatch[{b}]" in text}
        if "mlx-lm" in text or "mlx-vlm" in text:
            assert len(picked) == 1, (name, requirements)
    assert {"lm", "upstream", "lm-cuda", "upstream-cuda", "cpu", "cuda"} <= set(extras)


def test_test_requirements_are_a_dependency_group_not_an_extra():
    assert "test" not in PYPROJECT["project"]["optional-dependencies"]
    group = PYPROJECT["dependency-groups"]["test"]
    assert any(req.startswith("pytest") for req in group) and any(req.startswith("zizmor") for req in group)
    assert "test" not in (METADATA.get_all("Provides-Extra") or [])
    script = (REPO / "scripts" / "test.sh").read_text()
    assert "--group test" in script and ".[test]" not in script
