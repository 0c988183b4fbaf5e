"""Cheap environments for many upstream releases: cached *layers* stacked into *buckets*.

One shared base interpreter holds the heavy, version-insensitive dependencies (numpy,
transformers, ...). Each upstream release is a *layer*: the result of
``pip install --no-deps --target <cache>/layers/<name>-<version>-py<XY>/ <name>==<version>``,
built once and reused. A :class:`Bucket` is a set of layers put first on ``PYTHONPATH``, so
that both ``import`` and ``importlib.metadata`` find those releases before anything else.
The base interpreter must not have ``mlx``, ``mlx-cpu``, ``mlx-metal``, ``mlx-lm`` or
``mlx-vlm`` installed itself (see :func:`check_base`).

This module uses only the standard library and ``packaging``; it never imports mlx.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import (
    InvalidWheelFilename,
    canonicalize_name,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from .. import config
from ..store import Place, cache_root, locked

__all__ = [
    "BUCKET_VAR",
    "CACHE_VAR",
    "Bucket",
    "EnvBuildError",
    "bucket_environ",
    "build",
    "build_all",
    "cache_dir",
    "cached_versions",
    "check_base",
    "is_cached",
    "layer",
    "layer_key",
    "missing_layers",
]

log = logging.getLogger(__name__)

#: Environment variable that overrides the cache location.
CACHE_VAR = config.CACHE
#: Environment variable set to the bucket's name by :func:`bucket_environ`.
BUCKET_VAR = "KVPATCH_BUCKET"
#: Distributions the base interpreter must not provide: they come from layers only.
LAYERED_DISTRIBUTIONS = ("mlx", "mlx-cpu", "mlx-metal", "mlx-cuda", "mlx-lm", "mlx-vlm")
#: Packages whose wheels declare exactly-pinned platform companions (``mlx-cpu``, ``mlx-metal``,
#: ``mlx-cuda-*``) that must land in the same layer, as they share the ``mlx/`` directory.
_COMPANION_PACKAGES = frozenset({"mlx"})
#: Written into a finished layer just before it is renamed into place.
_MARKER = ".kvpatch-layer.json"
_STDERR_TAIL_LINES = 25
#: Skipped when hashing a source directory (build by-products, VCS data, caches).
_SKIP_DIRS = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        "__pycache__",
        "build",
        "dist",
        ".venv",
        "venv",
        ".tox",
        ".nox",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        "node_modules",
    }
)


class EnvBuildError(RuntimeError):
    """A layer could not be built; says which requirement, and ends with pip's stderr tail."""

    def __init__(self, message: str, requirement: str | None = None, stderr: str = "") -> None:
        self.message = message
        self.requirement = requirement
        self.stderr = stderr
        text = f"cannot build layer for {requirement!r}: {message}" if requirement else message
        tail = _tail(stderr)
        if tail:
            text += "\n--- pip stderr (tail) ---\n" + tail
        super().__init__(text)


def cache_dir() -> Path:
    """kvpatch's cache root (:func:`kvpatch.store.cache_root`): ``$KVPATCH_CACHE``, else
    ``$XDG_CACHE_HOME/kvpatch``, else ``~/.cache/kvpatch``."""
    root = cache_root()
    if root is None:
        raise RuntimeError(f"no home directory to keep the release layers in: set {CACHE_VAR}")
    return root


# --------------------------------------------------------------------------------------------
# Interpreters


@dataclass(frozen=True)
class _Interpreter:
    executable: str
    tag: str  # "311"
    platform_system: str  # what packaging's markers call platform_system


@cache
def _interpreter(python: str | None) -> _Interpreter:
    if python is None:
        import platform

        info = sys.version_info
        return _Interpreter(sys.executable, f"{info[0]}{info[1]}", platform.system())
    exe = shutil.which(python) or python
    if not Path(exe).exists():
        raise EnvBuildError(f"python interpreter {python!r} not found")
    code = "import sys, platform; print(f'{sys.version_info[0]}{sys.version_info[1]}'); print(platform.system())"
    try:
        out = subprocess.run(
            [exe, "-c", code], capture_output=True, text=True, check=True, env=_clean_env()
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError) as exc:
        raise EnvBuildError(f"cannot run python interpreter {python!r}: {exc}") from exc
    return _Interpreter(exe, out[0], out[1])


# --------------------------------------------------------------------------------------------
# Layer specs


@dataclass(frozen=True)
class _Spec:
    requirement: str  # as the caller gave it
    key: str  # directory name under <cache>/layers
    kind: str  # "pin", "wheel" or "source"
    name: str | None = None  # canonical distribution name ("pin", "wheel")
    version: str | None = None
    extras: tuple[str, ...] = ()
    path: Path | None = None  # "wheel", "source"


def _looks_like_path(requirement: str) -> bool:
    return (
        requirement.endswith(".whl")
        or requirement.startswith((".", "/", "~"))
        or os.sep in requirement
        or Path(requirement).expanduser().is_dir()
    )


def _spec(requirement: str, interp: _Interpreter) -> _Spec:
    py = f"py{interp.tag}"
    requirement = requirement.strip()
    if _looks_like_path(requirement):
        path = Path(requirement).expanduser().resolve()
        if path.is_file() and path.suffix == ".whl":
            try:
                wname, wversion, _, _ = parse_wheel_filename(path.name)
            except InvalidWheelFilename as exc:
                raise EnvBuildError(f"not a valid wheel file name: {exc}", requirement) from exc
            key = f"{wname}-{wversion}-{_file_digest(path)}-{py}"
            return _Spec(requirement, key, "wheel", str(wname), str(wversion), (), path)
        if path.is_dir():
            digest = _tree_digest(path)
            return _Spec(requirement, f"src-{_safe(path.name)}-{digest}-{py}", "source", path=path)
        raise EnvBuildError("no such wheel file or source directory", requirement)
    try:
        req = Requirement(requirement)
    except InvalidRequirement as exc:
        raise EnvBuildError(f"not a valid requirement: {exc}", requirement) from exc
    specs = list(req.specifier)
    if req.url or req.marker or len(specs) != 1 or specs[0].operator not in ("==", "===") or "*" in specs[0].version:
        raise EnvBuildError(
            "a layer needs one exact pin such as 'mlx-lm==0.23.2' or 'mlx[cpu]==0.26.5'",
            requirement,
        )
    name = canonicalize_name(req.name)
    version = specs[0].version
    extras = tuple(sorted(canonicalize_name(e) for e in req.extras))
    label = name + "".join(f"+{e}" for e in extras)
    return _Spec(requirement, f"{label}-{version}-{py}", "pin", name, version, extras)


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._+-" else "_" for c in text) or "src"


def _file_digest(path: Path) -> str:
    return _full_digest(path)[:12]


def _tree_digest(root: Path) -> str:
    """Content hash of a source tree, ignoring VCS data and build by-products."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info"))
        for fname in sorted(filenames):
            if fname.endswith((".pyc", ".pyo")):
                continue
            fpath = Path(dirpath, fname)
            if not fpath.is_file():
                continue
            h.update(fpath.relative_to(root).as_posix().encode() + b"\0")
            h.update(bytes.fromhex(_full_digest(fpath)))
    return h.hexdigest()[:12]


def _full_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def layer_key(requirement: str, python: str | None = None) -> str:
    """The directory name (under ``cache_dir()/"layers"``) that :func:`layer` uses."""
    return _spec(requirement, _interpreter(python)).key


def is_cached(requirement: str, python: str | None = None) -> bool:
    """True when :func:`layer` would find ``requirement``'s layer built (nothing to download)."""
    try:
        return _is_built(cache_dir() / "layers" / layer_key(requirement, python))
    except Exception:  # an unusual requirement: layer() will say what is wrong with it
        return False


def cached_versions(distribution: str, python: str | None = None) -> list[str]:
    """The versions of ``distribution`` whose plain layer (``name==version``) is built in the cache, oldest first."""
    name = canonicalize_name(distribution)
    tag = _interpreter(python).tag
    found = []
    for path in (cache_dir() / "layers").glob(f"{name}-*-py{tag}"):
        version = path.name[len(name) + 1 : -len(f"-py{tag}")]
        try:
            parsed = Version(version)
        except InvalidVersion:  # another distribution whose name starts the same (mlx / mlx-lm)
            continue
        if _is_built(path) and layer_key(f"{name}=={version}", python) == path.name:
            found.append(parsed)
    return [str(v) for v in sorted(found)]


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def missing_layers(requirements: Iterable[str], python: str | None = None) -> tuple[list[str], int, list[str]]:
    """What :func:`layer` would have to download for ``requirements``: (the requirements not cached, roughly how many
    bytes they take once installed, the ones whose size cannot be guessed). The guess for one is the median size of
    the cached layers of the same package (other versions), which is what a release of it usually weighs."""
    interp = _interpreter(python)
    missing = [r for r in dict.fromkeys(requirements) if not is_cached(r, python)]
    sizes: dict[str, list[int]] = {}
    total, unknown = 0, []
    for requirement in missing:
        try:
            spec = _spec(requirement, interp)
        except EnvBuildError:
            unknown.append(requirement)
            continue
        label = spec.key.removesuffix(f"-{spec.version}-py{interp.tag}") if spec.version else ""
        if label not in sizes:
            built = (cache_dir() / "layers").glob(f"{label}-*-py{interp.tag}")
            sizes[label] = sorted(_size(p) for p in built if _is_built(p) and p.name.count("-") == spec.key.count("-"))
        known = sizes[label]
        if spec.kind != "pin" or not known:
            unknown.append(requirement)
            continue
        total += known[len(known) // 2]
    return missing, total, unknown


# --------------------------------------------------------------------------------------------
# pip


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    for var in (
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONDONTWRITEBYTECODE",
        "PIP_TARGET",
        "PIP_PREFIX",
        "PIP_USER",
        "PIP_REQUIRE_VIRTUALENV",
    ):
        env.pop(var, None)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INPUT"] = "1"
    return env


def _pip(interp: _Interpreter, args: Sequence[str], requirement: str) -> None:
    cmd = [interp.executable, "-m", "pip", *args, "--cache-dir", str(cache_dir() / "pip")]
    log.debug("running %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env())
    except OSError as exc:
        raise EnvBuildError(f"cannot run pip: {exc}", requirement) from exc
    if proc.returncode != 0:
        raise EnvBuildError(
            f"pip {args[0]} exited with status {proc.returncode}",
            requirement,
            proc.stderr or proc.stdout,
        )


def _tail(text: str, lines: int = _STDERR_TAIL_LINES) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def _companions(wheel: Path, spec: _Spec, interp: _Interpreter) -> list[str]:
    """Exactly-pinned same-version requirements of a wheel that apply here with its extras.

    For ``mlx[cpu]==V`` on Linux that is ``mlx-cpu==V``; for ``mlx==V`` on macOS (0.27.1+) it
    is ``mlx-metal==V``.
    """
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(name).decode("utf-8", "replace")
    out: list[str] = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        try:
            req = Requirement(line.split(":", 1)[1].strip())
        except InvalidRequirement:
            continue
        pins = [s for s in req.specifier if s.operator == "==" and s.version == spec.version]
        if not pins or len(req.specifier) != 1 or not canonicalize_name(req.name).startswith(f"{spec.name}-"):
            continue
        if req.marker is not None and not _marker_applies(req.marker, spec.extras, interp):
            continue
        out.append(f"{canonicalize_name(req.name)}=={spec.version}")
    return out


def _marker_applies(marker: Marker, extras: Iterable[str], interp: _Interpreter) -> bool:
    base = {"platform_system": interp.platform_system}
    return any(marker.evaluate({**base, "extra": e}) for e in ("", *extras))


# --------------------------------------------------------------------------------------------
# Layers


def _is_built(path: Path) -> bool:
    return (path / _MARKER).is_file()


def layer(requirement: str, python: str | None = None) -> Path:
    """Install one release into its cached layer directory (once) and return that directory.

    ``requirement`` is an exact pin (``"mlx-lm==0.23.2"``; ``"mlx[cpu]==0.26.5"`` also installs
    the exactly-pinned companion wheel ``mlx-cpu==0.26.5``, and plain ``mlx`` on macOS gets
    ``mlx-metal``), a local ``.whl`` file, or a source directory (built by pip; cached by a
    hash of its content). Everything is installed with ``--no-deps``.

    ``python`` is the interpreter the layer is for (default: this one); pip runs under it, so
    compiled wheels and byte code match it, and the layer's name ends in ``-py<XY>``.

    The install goes to a temporary directory that is renamed into place when complete, under
    a per-layer file lock, so racing processes and interrupted builds are safe.
    """
    interp = _interpreter(python)
    spec = _spec(requirement, interp)
    layers = cache_dir() / "layers"
    final = layers / spec.key
    if _is_built(final):
        return final
    layers.mkdir(parents=True, exist_ok=True)
    # kvpatch's one file lock (no symlink followed; a directory another user can write is refused)
    with locked(Place(layers / ".locks", cache_dir()), f"{spec.key}.lock", wait=True, what="release layers"):
        if _is_built(final):
            return final
        # With the lock held, temp dirs for this key are leftovers of a killed build.
        for stale in layers.glob(f".tmp-{spec.key}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # no marker: not ours to trust
            shutil.rmtree(final, ignore_errors=True)
        started = time.monotonic()
        log.info("building layer %s", spec.key)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.key}-", dir=layers))
        tmp.chmod(0o755)  # mkdtemp makes it 0700; a shared cache must be readable
        try:
            installed = _install(spec, interp, tmp)
            info = {
                "requirement": spec.requirement,
                "kind": spec.kind,
                "pip_args": installed,
                "dists": _dists(tmp),
                "python": interp.executable,
                "python_tag": interp.tag,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            (tmp / _MARKER).write_text(json.dumps(info, indent=1) + "\n")
            try:
                tmp.rename(final)
            except OSError:
                if not _is_built(final):  # pragma: no cover - only without a working flock
                    raise
        finally:
            if tmp.exists():  # failed, or lost a race: the finished layer is final, not tmp
                shutil.rmtree(tmp, ignore_errors=True)
        log.info("built layer %s in %.1fs", spec.key, time.monotonic() - started)
    return final


def _install(spec: _Spec, interp: _Interpreter, target: Path) -> list[str]:
    common = ["--no-deps", "--no-warn-script-location", "--target", str(target)]
    targets: list[str]
    if spec.kind == "pin":
        assert spec.name is not None and spec.version is not None
        pin = f"{spec.name}=={spec.version}"
        targets = [pin]
        if spec.extras or spec.name in _COMPANION_PACKAGES:
            with tempfile.TemporaryDirectory(prefix="kvpatch-dl-") as dl:
                _pip(interp, ["download", "--no-deps", "--only-binary", ":all:", "-d", dl, pin], spec.requirement)
                wheels = list(Path(dl).glob("*.whl"))
                if len(wheels) == 1:
                    targets += _companions(wheels[0], spec, interp)
                elif spec.extras:
                    raise EnvBuildError(f"expected one wheel for {pin}", spec.requirement)
                _pip(interp, ["install", *common, *targets], spec.requirement)
                return targets
    else:
        assert spec.path is not None
        targets = [str(spec.path)]
    _pip(interp, ["install", *common, *targets], spec.requirement)
    return targets


def _dists(root: Path) -> list[str]:
    """``name==version`` of every distribution installed directly in ``root``."""
    out = []
    for meta in sorted(root.glob("*.dist-info/METADATA")):
        fields: dict[str, str] = {}
        for line in meta.read_text(encoding="utf-8", errors="replace").splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields.setdefault(key.strip().lower(), value.strip())
        if "name" in fields:
            out.append(f"{canonicalize_name(fields['name'])}=={fields.get('version', '?')}")
    return out


# --------------------------------------------------------------------------------------------
# Buckets


@dataclass(frozen=True)
class Bucket:
    """A named set of layers that are put first on ``PYTHONPATH`` together.

    ``pins`` are the upstream releases under test (``("mlx[cpu]==0.26.5", "mlx-lm==0.23.2")``);
    ``extra`` are version-sensitive dependencies layered too (``("transformers==4.51.3",)``).
    """

    name: str
    pins: tuple[str, ...]
    extra: tuple[str, ...] = ()

    @property
    def requirements(self) -> tuple[str, ...]:
        """All layer requirements, in ``PYTHONPATH`` order."""
        return self.pins + self.extra

    def version(self, distribution: str) -> str | None:
        """The pinned version of ``distribution`` in this bucket (``pins`` or ``extra``)."""
        want = canonicalize_name(distribution)
        for text in self.requirements:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            if canonicalize_name(req.name) == want:
                for spec in req.specifier:
                    if spec.operator in ("==", "==="):
                        return spec.version
        return None


def build(bucket: Bucket, python: str | None = None) -> list[Path]:
    """Build (or find cached) every layer of ``bucket``; return them in ``PYTHONPATH`` order."""
    paths = []
    for req in bucket.requirements:
        try:
            paths.append(layer(req, python))
        except EnvBuildError as exc:
            raise EnvBuildError(f"{exc.message} (bucket {bucket.name})", exc.requirement, exc.stderr) from exc
    return paths


def build_all(buckets: Iterable[Bucket], python: str | None = None, jobs: int = 4) -> dict[str, list[Path]]:
    """Build the layers of many buckets, each distinct layer once, ``jobs`` pip runs at a time.

    Returns ``{bucket.name: layers}``. All layers are attempted; the first failure is then
    raised.
    """
    buckets = list(buckets)
    unique = list(dict.fromkeys(req for b in buckets for req in b.requirements))
    built: dict[str, Path] = {}
    errors: list[EnvBuildError] = []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {req: pool.submit(layer, req, python) for req in unique}
        for req, fut in futures.items():
            try:
                built[req] = fut.result()
            except EnvBuildError as exc:
                log.error("%s", exc)
                errors.append(exc)
    if errors:
        raise errors[0]
    return {b.name: [built[req] for req in b.requirements] for b in buckets}


def bucket_environ(bucket: Bucket, base: Mapping[str, str] | None = None, python: str | None = None) -> dict[str, str]:
    """An environment for running the base interpreter on ``bucket``'s releases.

    A copy of ``base`` (default ``os.environ``) with the bucket's layers (built if needed)
    first on ``PYTHONPATH``, followed by whatever ``PYTHONPATH`` already held, and
    ``KVPATCH_BUCKET`` set to the bucket's name.
    """
    env = dict(os.environ if base is None else base)
    paths = [str(p) for p in build(bucket, python)]
    previous = env.get("PYTHONPATH", "")
    paths += [p for p in previous.split(os.pathsep) if p and p not in paths]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[BUCKET_VAR] = bucket.name
    return env


def check_base(python: str | None = None) -> list[str]:
    """Distributions in :data:`LAYERED_DISTRIBUTIONS` that ``python`` itself provides.

    They would shadow nothing for ``import`` (layers come first) but would still show up in
    ``importlib.metadata.distributions()``; the base env should have none. Returns
    ``["name==version", ...]``, empty when the base is clean.
    """
    interp = _interpreter(python)
    code = (
        "import importlib.metadata as m, json, sys\n"
        f"names = {list(LAYERED_DISTRIBUTIONS)!r}\n"
        "found = []\n"
        "for d in m.distributions():\n"
        "    n = (d.metadata['Name'] or '').lower().replace('_', '-')\n"
        "    if n in names or n.startswith('mlx-cuda'):\n"
        '        found.append(f"{n}=={d.version}")\n'
        "print(json.dumps(sorted(set(found))))\n"
    )
    proc = subprocess.run([interp.executable, "-c", code], capture_output=True, text=True, env=_clean_env())
    if proc.returncode != 0:
        raise EnvBuildError("cannot inspect the base interpreter", stderr=proc.stderr)
    result: list[str] = json.loads(proc.stdout)
    return result
