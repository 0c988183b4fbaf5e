"""kvpatch.maint.envs: cache location, layer naming, bucket environments, locking. No network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from kvpatch.maint import envs
from kvpatch.maint.envs import Bucket, EnvBuildError, bucket_environ, build, build_all, cache_dir, layer, layer_key

PY = f"py{sys.version_info[0]}{sys.version_info[1]}"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("KVPATCH_CACHE", str(root))
    return root


def fake_layer(cache: Path, requirement: str) -> Path:
    """Make ``requirement``'s layer look built, without pip."""
    path = cache / "layers" / layer_key(requirement)
    path.mkdir(parents=True)
    (path / ".kvpatch-layer.json").write_text("{}")
    return path


def make_wheel(directory: Path, name: str = "kvfake", version: str = "1.2.3") -> Path:
    """A minimal pure-Python wheel providing module ``name``."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": "VALUE = 42\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{dist}/RECORD,,\n"
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for fname, text in files.items():
            zf.writestr(fname, text)
    return path


def have_pip() -> bool:
    proc = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    return proc.returncode == 0


# --- cache_dir ---------------------------------------------------------------------------------


def test_cache_dir_prefers_kvpatch_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPATCH_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert cache_dir() == tmp_path / "a"


def test_cache_dir_falls_back_to_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("KVPATCH_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert cache_dir() == tmp_path / "b" / "kvpatch"


def test_cache_dir_defaults_to_home(monkeypatch, tmp_path):
    monkeypatch.delenv("KVPATCH_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "kvpatch"


def test_empty_variables_are_ignored(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPATCH_CACHE", "")
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "kvpatch"


# --- layer names and validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("requirement", "key"),
    [
        ("mlx-lm==0.23.2", f"mlx-lm-0.23.2-{PY}"),
        ("MLX_LM == 0.23.2", f"mlx-lm-0.23.2-{PY}"),
        ("mlx[cpu]==0.26.5", f"mlx+cpu-0.26.5-{PY}"),
        ("transformers===4.57.6", f"transformers-4.57.6-{PY}"),
    ],
)
def test_layer_key(requirement, key):
    assert layer_key(requirement) == key


@pytest.mark.parametrize(
    "requirement",
    ["mlx-lm", "mlx-lm>=0.23", "mlx-lm==0.23.*", "mlx-lm==0.23.2,<1", "mlx-lm==0.23.2; python_version>'3'", "!!"],
)
def test_layer_rejects_anything_but_one_exact_pin(requirement, cache):
    with pytest.raises(EnvBuildError, match="cannot build layer for"):
        layer(requirement)
    assert not (cache / "layers").exists()


def test_layer_rejects_missing_path(tmp_path):
    with pytest.raises(EnvBuildError, match="no such wheel file or source directory"):
        layer(str(tmp_path / "nope-1.0-py3-none-any.whl"))


def test_local_wheel_key_has_name_version_and_content_hash(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = make_wheel(tmp_path / "a")
    second = make_wheel(tmp_path / "b")
    with zipfile.ZipFile(second, "a") as zf:
        zf.writestr("extra.txt", "changed")
    k1, k2 = layer_key(str(first)), layer_key(str(second))
    assert k1.startswith("kvfake-1.2.3-") and k1.endswith(f"-{PY}")
    assert k1 != k2


def test_source_dir_key_ignores_build_products(tmp_path):
    src = tmp_path / "mlx-lm"
    (src / "mlx_lm").mkdir(parents=True)
    (src / "mlx_lm" / "__init__.py").write_text("x = 1\n")
    key = layer_key(str(src))
    assert key.startswith("src-mlx-lm-") and key.endswith(f"-{PY}")
    for junk in ("build/lib/x.py", ".git/HEAD", "mlx_lm/__pycache__/a.pyc", "mlx_lm.egg-info/PKG-INFO"):
        (src / junk).parent.mkdir(parents=True, exist_ok=True)
        (src / junk).write_text("junk")
    assert layer_key(str(src)) == key
    (src / "mlx_lm" / "__init__.py").write_text("x = 2\n")
    assert layer_key(str(src)) != key


# --- companions of mlx[cpu] --------------------------------------------------------------------

MLX_METADATA = """Metadata-Version: 2.1
Name: mlx
Version: 0.30.1
Requires-Dist: mlx-metal==0.30.1; platform_system == "Darwin"
Requires-Dist: mlx-cuda-12==0.30.1; platform_system == "Linux" and extra == "cuda"
Requires-Dist: mlx-cpu==0.30.1; platform_system == "Linux" and extra == "cpu"
Requires-Dist: numpy>=2; extra == "dev"
Requires-Dist: numpy==0.30.1; extra == "cpu"
"""


@pytest.mark.parametrize(
    ("requirement", "system", "expected"),
    [
        ("mlx[cpu]==0.30.1", "Linux", ["mlx-cpu==0.30.1"]),
        ("mlx[cuda]==0.30.1", "Linux", ["mlx-cuda-12==0.30.1"]),
        ("mlx==0.30.1", "Linux", []),
        ("mlx==0.30.1", "Darwin", ["mlx-metal==0.30.1"]),
        ("mlx[cpu]==0.30.1", "Darwin", ["mlx-metal==0.30.1"]),
    ],
)
def test_companions_are_exact_same_version_pins(tmp_path, requirement, system, expected):
    wheel = tmp_path / "mlx-0.30.1-cp311-cp311-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("mlx-0.30.1.dist-info/METADATA", MLX_METADATA)
    interp = envs._Interpreter(sys.executable, "311", system)
    spec = envs._spec(requirement, interp)
    assert envs._companions(wheel, spec, interp) == expected


# --- buckets -----------------------------------------------------------------------------------

BUCKET = Bucket("lm-0.23.2", ("mlx[cpu]==0.26.5", "mlx-lm==0.23.2"), ("transformers==4.57.6",))


def test_cached_versions_are_the_built_plain_layers_of_one_distribution(cache):
    for requirement in ("mlx-lm==0.32.2", "mlx-lm==0.28.0", "mlx[cpu]==0.32.4", "mlx-vlm==0.7.10"):
        fake_layer(cache, requirement)
    (cache / "layers" / layer_key("mlx-lm==0.31.3")).mkdir()  # unfinished: no marker
    assert envs.cached_versions("mlx-lm") == ["0.28.0", "0.32.2"]
    assert envs.cached_versions("mlx") == []  # mlx[cpu] is another layer; mlx-lm's do not start "mlx-<version>"


def test_missing_layers_says_what_a_build_would_download_and_roughly_how_much(cache):
    (fake_layer(cache, "mlx-lm==0.32.2") / "blob").write_bytes(b"x" * 3000)
    (fake_layer(cache, "mlx-lm==0.28.0") / "blob").write_bytes(b"x" * 1000)
    (fake_layer(cache, "mlx-lm==0.30.2") / "blob").write_bytes(b"x" * 2000)
    missing, size, unknown = envs.missing_layers(["mlx-lm==0.32.2", "mlx-lm==0.32.1", "mlx[cpu]==0.32.4"])
    assert missing == ["mlx-lm==0.32.1", "mlx[cpu]==0.32.4"]
    assert unknown == ["mlx[cpu]==0.32.4"]  # no mlx[cpu] layer cached to guess from
    assert 2000 <= size < 2200  # the median mlx-lm layer (and its marker file)
    assert envs.missing_layers(["mlx-lm==0.32.2"]) == ([], 0, [])


def test_bucket_requirements_and_versions():
    assert BUCKET.requirements == ("mlx[cpu]==0.26.5", "mlx-lm==0.23.2", "transformers==4.57.6")
    assert BUCKET.version("mlx") == "0.26.5"
    assert BUCKET.version("MLX_LM") == "0.23.2"
    assert BUCKET.version("transformers") == "4.57.6"
    assert BUCKET.version("mlx-vlm") is None


def test_bucket_environ_puts_layers_first(cache):
    layers = [fake_layer(cache, r) for r in BUCKET.requirements]
    base = {"PYTHONPATH": os.pathsep.join(["/somewhere", str(layers[1])]), "OTHER": "1"}
    env = bucket_environ(BUCKET, base=base)
    assert env["PYTHONPATH"].split(os.pathsep) == [*map(str, layers), "/somewhere"]
    assert env["KVPATCH_BUCKET"] == "lm-0.23.2"
    assert env["OTHER"] == "1"
    assert base["PYTHONPATH"] == os.pathsep.join(["/somewhere", str(layers[1])])  # not mutated


def test_bucket_environ_defaults_to_os_environ(cache, monkeypatch):
    layers = [fake_layer(cache, r) for r in BUCKET.requirements]
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setenv("KVPATCH_TEST_MARK", "yes")
    env = bucket_environ(BUCKET)
    assert env["PYTHONPATH"] == os.pathsep.join(map(str, layers))
    assert env["KVPATCH_TEST_MARK"] == "yes"


def test_build_all_builds_each_layer_once(cache, monkeypatch):
    calls: list[str] = []

    def install(spec, interp, target):
        calls.append(spec.requirement)
        return []

    monkeypatch.setattr(envs, "_install", install)
    other = Bucket("lm-0.24.0", ("mlx[cpu]==0.26.5", "mlx-lm==0.24.0"))
    result = build_all([BUCKET, other], jobs=3)
    assert sorted(calls) == sorted({*BUCKET.requirements, *other.requirements})
    assert result["lm-0.24.0"][0] == result["lm-0.23.2"][0] == cache / "layers" / layer_key("mlx[cpu]==0.26.5")
    assert build(other) == result["lm-0.24.0"]  # cached: no more installs
    assert len(calls) == 4


# --- atomicity and locking ---------------------------------------------------------------------


def test_racing_builders_install_once(cache, monkeypatch):
    calls: list[str] = []

    def install(spec, interp, target):
        calls.append(spec.key)
        time.sleep(0.3)
        (target / "mod.py").write_text("")
        return []

    monkeypatch.setattr(envs, "_install", install)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(layer("mlx-lm==0.23.2"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [layer_key("mlx-lm==0.23.2")]
    assert len(set(results)) == 1
    assert (results[0] / "mod.py").exists()
    assert json.loads((results[0] / ".kvpatch-layer.json").read_text())["requirement"] == "mlx-lm==0.23.2"


def test_failed_build_leaves_nothing(cache, monkeypatch):
    def install(spec, interp, target):
        (target / "half.py").write_text("")
        raise EnvBuildError("pip install exited with status 1", spec.requirement, "ERROR: boom")

    monkeypatch.setattr(envs, "_install", install)
    with pytest.raises(EnvBuildError, match="boom"):
        layer("mlx-lm==0.23.2")
    assert [p.name for p in (cache / "layers").iterdir()] == [".locks"]


def test_stale_temp_dirs_and_unfinished_layers_are_replaced(cache, monkeypatch):
    key = layer_key("mlx-lm==0.23.2")
    stale = cache / "layers" / f".tmp-{key}-dead"
    stale.mkdir(parents=True)
    unfinished = cache / "layers" / key
    unfinished.mkdir()
    (unfinished / "junk.py").write_text("")

    def install(spec, interp, target):
        (target / "mod.py").write_text("")
        return []

    monkeypatch.setattr(envs, "_install", install)
    path = layer("mlx-lm==0.23.2")
    assert path == unfinished and (path / "mod.py").exists() and not (path / "junk.py").exists()
    assert not stale.exists()


# --- real pip, offline -------------------------------------------------------------------------


@pytest.mark.skipif(not have_pip(), reason="pip is not available to this interpreter")
def test_local_wheel_layer_is_importable_and_visible_to_metadata(cache, tmp_path):
    wheel = make_wheel(tmp_path)
    bucket = Bucket("fake", (str(wheel),))
    env = bucket_environ(bucket, base={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    (path,) = build(bucket)
    assert env["PYTHONPATH"] == str(path)
    info = json.loads((path / ".kvpatch-layer.json").read_text())
    assert info["dists"] == ["kvfake==1.2.3"]
    code = "import kvfake, importlib.metadata as m, os; print(kvfake.VALUE, m.version('kvfake'), os.environ['KVPATCH_BUCKET'])"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert out.stdout.split() == ["42", "1.2.3", "fake"]


@pytest.mark.skipif(not have_pip(), reason="pip is not available to this interpreter")
def test_pip_failure_names_the_pin_and_shows_pip_stderr(cache, monkeypatch, tmp_path):
    # No index, no find-links: pip fails at once without touching the network.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(EnvBuildError) as info:
        layer("kvpatch-no-such-dist==0.0.1")
    message = str(info.value)
    assert "'kvpatch-no-such-dist==0.0.1'" in message
    assert "No matching distribution" in message
    assert info.value.requirement == "kvpatch-no-such-dist==0.0.1"
    assert not any(p.name.startswith(".tmp-") for p in (cache / "layers").iterdir())


def test_build_error_names_bucket_and_pin(cache, monkeypatch):
    def install(spec, interp, target):
        raise EnvBuildError("pip install exited with status 1", spec.requirement, "ERROR: No matching distribution")

    monkeypatch.setattr(envs, "_install", install)
    with pytest.raises(EnvBuildError) as info:
        build(BUCKET)
    assert info.value.requirement == "mlx[cpu]==0.26.5"
    assert "(bucket lm-0.23.2)" in str(info.value)
    assert "'mlx[cpu]==0.26.5'" in str(info.value)
    assert "No matching distribution" in str(info.value)


def test_test_extra_installs_the_matrix_base():
    """pyproject's `test` extra must carry what every matrix bucket's shared base needs."""
    import re

    from matrix import BASE_REQUIREMENTS
    from support import REPO

    text = (REPO / "pyproject.toml").read_text()
    extra = text[text.index("test = [") : text.index("]", text.index("test = ["))]
    declared = set(re.findall(r'"([^"]+)"', extra))
    assert set(BASE_REQUIREMENTS) <= declared, set(BASE_REQUIREMENTS) - declared
