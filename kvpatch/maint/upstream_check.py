"""``python -m kvpatch upstream-check``: is every patch still needed on the newest upstream releases?

The check installs the upstream releases it is given (default: the newest mlx-lm and mlx-vlm on the
package index, ignoring releases younger than 48 hours) as cached *layers* (:mod:`kvpatch.maint.envs`)
over the *current* interpreter, pairs them with the newest mlx their ``Requires-Dist`` accepts, and
measures every relevant patch in a child process, as ``kvpatch verify`` does: its reproduction without the
patch and with it (:meth:`kvpatch.engine.Engine.measure`). The user's own environment is never modified: layers
live under :func:`kvpatch.maint.envs.cache_dir` and are put first on the child's ``PYTHONPATH`` only.

Per patch it reports what was measured:

``still needed``             the bug reproduces (the run with the patch shows whether the patch still
                             fixes it);
``fixed upstream in <X>``    the bug is absent; ``<X>`` is the first fixed release, found by bisecting
                             the releases after the record's ``checked_through``;
``target moved or gone``     a target the patch changes is missing (retarget or retire the patch);
``could not run``            why (environment, crash, or the reproduction cannot run on this backend);
``inconclusive``             the reproduction hit an error that is not the bug's own symptom (the error is
                             shown): a fact about that environment, never a reason to edit a record;
``not relevant``             the patch's distribution is not checked, the release predates the affected
                             range, or the release is past the patch's ``fixed_in``.

and whether that agrees with the record (:func:`judge`). Exit status 0 when every record agrees with
what was measured, 1 otherwise. ``--json`` prints schema ``kvpatch.upstream-check/1``.

The gate never asks the package index anything; only this maintainer command does.
"""

from __future__ import annotations

import argparse
import datetime as dt
import email.parser
import enum
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from ..gate import LOWER_BOUND, PINNED, Action, misplaced
from ..record import DISTRIBUTIONS, Finding, Kind, Patch
from . import envs
from .expiry import patch_file

__all__ = [
    "FRESH_HOURS",
    "SCHEMA",
    "Agreement",
    "Expect",
    "Measured",
    "Release",
    "absent_advice",
    "expectation",
    "index_releases",
    "judge",
    "main",
    "newest",
    "patch_file",
    "relevant",
]

SCHEMA = "kvpatch.upstream-check/1"
#: Releases younger than this are ignored unless ``--include-fresh`` (a broken release is often
#: yanked or followed by a fix within a day or two).
FRESH_HOURS = 48
#: Marks the child's result lines on stdout (reproductions and upstream may print too).
_MARK = "KVPATCH-UPSTREAM-CHECK "
_DEFAULT_INDEX = "https://pypi.org/simple"


# --------------------------------------------------------------------------------------------
# What the record expects, and whether the measurement agrees (pure; tested table-driven in tests/engine/test_expiry.py)


class Expect(enum.Enum):
    NOT_RELEVANT = "not relevant"
    NEEDED = "still needed"  # the release is in the affected range
    ABSENT = "bug absent"  # the release is the record's fixed_in (or past it, when pinned)
    NEWER = "still needed or fixed"  # unfixed record, release newer than checked_through: to be measured
    UNSETTLED = "either"  # between the affected range and the fix: the record does not say


class Measured(enum.Enum):
    NEEDED = "still needed"
    FIXED = "fixed upstream"
    MOVED = "target moved or gone"
    COULD_NOT_RUN = "could not run"
    #: The reproduction ran into an error that is not the bug's own symptom (see kvpatch.record.symptom).
    INCONCLUSIVE = "inconclusive"
    NOT_RELEVANT = "not relevant"


@dataclass(frozen=True)
class Agreement:
    #: True agrees, False disagrees (exit 1), None: nothing to compare (not relevant, skipped).
    agrees: bool | None
    expected: str
    #: What the maintainer must (disagreement) or may (agreement) change, one item per record field.
    advice: tuple[str, ...] = ()


def _lower_bounds(patch: Patch) -> list[str]:
    return [str(s) for s in patch.range if s.operator in (">=", ">", "==", "~=")]


def _range_through(patch: Patch, last: str) -> str:
    return ",".join([*_lower_bounds(patch), f"<={last}"])


def _range_before(patch: Patch, fixed: str) -> str:
    return ",".join([*_lower_bounds(patch), f"<{fixed}"])


def _below(patch: Patch, version: Version) -> bool:
    return any(s.operator in (">=", ">") and not s.contains(version, prereleases=True) for s in patch.range)


def expectation(patch: Patch, release: str) -> Expect:
    """What ``patch``'s record says about ``release`` of its own distribution."""
    version = Version(release)
    if _below(patch, version):
        return Expect.NOT_RELEVANT
    fixed = Version(patch.fixed_in) if patch.fixed_in else None
    if fixed is not None and version >= fixed:
        # The fixing release itself (or a post/local build of it) must be clean; later ones are past the range.
        return Expect.ABSENT if version.release == fixed.release else Expect.NOT_RELEVANT
    if patch.range.contains(version, prereleases=True):
        if fixed is None and patch.checked_through and version > Version(patch.checked_through):
            return Expect.NEWER
        return Expect.NEEDED
    if fixed is None and (patch.checked_through is None or version > Version(patch.checked_through)):
        return Expect.NEWER
    return Expect.UNSETTLED


def relevant(patch: Patch, versions: dict[str, str]) -> bool:
    """Only patches whose distribution is checked and whose range does not end before its release."""
    release = versions.get(patch.distribution)
    return release is not None and expectation(patch, release) is not Expect.NOT_RELEVANT


def judge(
    patch: Patch,
    release: str,
    measured: Measured,
    *,
    first_fixed: str | None = None,
    patched_fixes: bool | None = None,
    patched_state: str | None = None,
    skipped: bool = False,
    local: bool = False,
) -> Agreement:
    """Does ``measured`` (on ``release`` of the patch's distribution) agree with the record?

    ``first_fixed``: the first release without the bug when bisected (default: ``release``).
    ``patched_fixes``: whether the patch (kvpatch active) removes the bug on ``release``.
    ``skipped``: the reproduction declared it cannot run here (no verdict).
    ``local``: ``release`` is a local wheel or source tree, not a published release.
    """
    expect = expectation(patch, release)
    if local and expect is Expect.ABSENT:
        # A source tree declares the *upcoming* version before the fix may have landed in it.
        expect = Expect.UNSETTLED
    where = patch_file(patch)
    dist = patch.distribution
    if measured is Measured.NOT_RELEVANT or expect is Expect.NOT_RELEVANT:
        return Agreement(None, Expect.NOT_RELEVANT.value)
    if measured is Measured.INCONCLUSIVE:
        return Agreement(
            False,
            expect.value,
            (
                f"{where}: the reproduction was inconclusive on {dist} {release} (an error that is not the bug's "
                "symptom): not a record error; fix the environment, or make the reproduction catch only the bug's "
                "own symptom",
            ),
        )
    if measured is Measured.COULD_NOT_RUN:
        if skipped:
            return Agreement(None, expect.value)
        return Agreement(
            False,
            expect.value,
            (f"{where}: the reproduction could not run on {dist} {release}: fix the environment or the reproduction",),
        )
    if measured is Measured.MOVED:
        return Agreement(
            False,
            expect.value,
            (
                f"{where}: a target moved or is gone in {dist} {release}: retarget the patch if the bug is still "
                "there, or retire it (set fixed_in) if upstream removed the buggy code",
            ),
        )
    if measured is Measured.NEEDED:
        if expect is Expect.ABSENT:
            return Agreement(
                False,
                expect.value,
                (
                    f"{where}: fixed_in={patch.fixed_in!r} but the bug reproduces on {dist} {release}: "
                    "find the real fixing release and correct fixed_in / fixed_commit / affected",
                ),
            )
        if patched_fixes is False:
            state = f" (state: {patched_state})" if patched_state else ""
            if local and patch.fixed_in and Version(release) >= Version(patch.fixed_in):
                return Agreement(
                    False,
                    expect.value,
                    (
                        f"{where}: the local {dist} build declares {release} (>= fixed_in {patch.fixed_in!r}) but has "
                        f"the bug, and kvpatch leaves it unpatched{state}: the fix is not in this tree yet",
                    ),
                )
            return Agreement(
                False,
                expect.value,
                (
                    f"{where}: bug still there on {dist} {release}, but the patch does not fix it{state}: rework its "
                    "builders (the fix), or the reproduction if it measures something the fix does not touch",
                ),
            )
        if expect is Expect.NEWER and not local:
            return Agreement(
                True,
                expect.value,
                (
                    f"{where}: bump checked_through {patch.checked_through!r} -> {release!r}",
                    f"{where}: widen affected {patch.affected!r} -> {_range_through(patch, release)!r}",
                ),
            )
        return Agreement(True, expect.value)
    # Measured.FIXED: the bug is absent.
    if expect in (Expect.ABSENT, Expect.UNSETTLED):
        return Agreement(True, expect.value)
    fixed = first_fixed or release
    if local:
        return Agreement(
            False,
            expect.value,
            (
                f"{where}: the bug is absent in the local {dist} build {release}: when that change is released, set "
                "fixed_in to its release and schedule the patch's removal",
            ),
        )
    advice = [
        f"{where}: set fixed_in={fixed!r} (and fixed_commit to upstream's fixing commit)",
        f"{where}: set affected={_range_before(patch, fixed)!r}",
    ]
    if patch.checked_through is not None:
        advice.append(f"{where}: set checked_through=None (was {patch.checked_through!r})")
    advice.append(
        f"{where}: set expiry condition to 'retire when kvpatch stops supporting {dist} < {fixed}' "
        "(kvpatch.maint.expiry then reports the patch for deletion once SUPPORTED_FLOOR reaches it)"
    )
    if expect is Expect.NEEDED:
        advice.insert(0, f"{where}: the record says {dist} {release} is affected, but the bug is absent there")
    return Agreement(False, expect.value, tuple(advice))


def absent_advice(patch: Patch, release: str, *, commit: str | None = None) -> list[str]:
    """What to change when the bug is absent without the patch on ``release`` (installed from git ``commit``, if
    given) although the record calls it affected, chosen by where the release sits in the record: the fields of
    CONTRIBUTING.md, "The record". ``tests/upstream/test_regressions.py`` prints it."""
    lines = _absent_advice(patch, release, commit)
    return [*lines, f"after changing the record: `python -m kvpatch.maint.regenerate --only {patch.id}`"]


def _absent_advice(patch: Patch, release: str, commit: str | None) -> list[str]:
    where, dist = patch_file(patch), patch.distribution
    measure = f"`python -m kvpatch upstream-check --{dist} {release}` measures it without the patch"
    field = misplaced(patch, release, commit, Action.APPLY)  # the runtime's rule: status --verify names it too
    if field == PINNED:
        pin = (commit or "")[:8]
        return [
            f"{where}: {dist} is installed from git commit {pin}, which the commit index places inside the range:",
            f"  if {pin} predates the bug, set introduced_commit to the commit that brought it in;",
            f"  if {pin} has upstream's fix, set fixed_commit (and fixed_in) to the fixing commit (and its release)",
        ]
    if field == LOWER_BOUND:
        return [
            f"{where}: {dist} {release} is the lower bound of affected={patch.affected!r} but has no bug: if the bug "
            f"came later, raise the lower bound to the first release that has it; if it is there, fix the "
            f"reproduction ({measure})"
        ]
    if field == "fixed_in":
        return [
            f"{where}: {dist} {release} ends affected={patch.affected!r} but has no bug. If upstream fixed it there:",
            *(f"  {line}" for line in judge(patch, release, Measured.FIXED).advice[1:]),
            f"  otherwise fix the reproduction ({measure})",
        ]
    return [
        f"{where}: {dist} {release} lies inside affected={patch.affected!r} but has no bug: the reproduction misses "
        f"it here ({measure}), or the range has a gap (narrow affected, or add '!={release}' to it)"
    ]


# --------------------------------------------------------------------------------------------
# The package index


@dataclass(frozen=True)
class Release:
    version: str
    uploaded: dt.datetime | None = None

    def age_hours(self, now: dt.datetime) -> float | None:
        if self.uploaded is None:
            return None
        return (now - self.uploaded).total_seconds() / 3600


def _index_url() -> str:
    return (os.environ.get("PIP_INDEX_URL") or _DEFAULT_INDEX).rstrip("/")


def _parse_time(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    try:
        value = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)


def _file_version(filename: str) -> str | None:
    try:
        if filename.endswith(".whl"):
            return str(parse_wheel_filename(filename)[1])
        return str(parse_sdist_filename(filename)[1])
    except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
        return None


def _releases_from_files(files: Iterable[dict[str, Any]], time_key: str) -> list[Release]:
    first: dict[str, dt.datetime | None] = {}
    for f in files:
        if f.get("yanked"):
            continue
        version = _file_version(str(f.get("filename", "")))
        if version is None:
            continue
        when = _parse_time(f.get(time_key))
        old = first.get(version)
        if version not in first or (when is not None and (old is None or when < old)):
            first[version] = when
    return [Release(v, t) for v, t in first.items()]


def _get_json(url: str, accept: str, timeout: float = 30) -> Any:
    request = urllib.request.Request(url, headers={"Accept": accept, "User-Agent": "kvpatch-upstream-check"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def _pip_index_versions(name: str) -> list[Release]:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", name],
        capture_output=True,
        text=True,
        env=envs._clean_env(),
        timeout=300,
    )
    for line in proc.stdout.splitlines():
        if line.strip().startswith("Available versions:"):
            return [Release(v.strip()) for v in line.split(":", 1)[1].split(",") if v.strip()]
    raise RuntimeError(f"pip index versions {name} failed: {(proc.stderr or proc.stdout).strip()[-400:]}")


def index_releases(name: str) -> tuple[list[Release], str]:
    """Every non-yanked release of ``name`` with its first upload time, and where that came from.

    Tries the index's JSON API (PEP 691/700: upload times), then PyPI's JSON API, then
    ``pip index versions`` (no dates: the 48-hour rule cannot be applied).
    """
    name = canonicalize_name(name)
    errors: list[str] = []
    index = _index_url()
    try:
        data = _get_json(f"{index}/{name}/", "application/vnd.pypi.simple.v1+json")
        releases = _releases_from_files(data.get("files", []), "upload-time")
        if releases:
            return releases, f"{index} (JSON API)"
        errors.append(f"{index}: no files")
    except Exception as exc:
        errors.append(f"{index}: {type(exc).__name__}: {exc}")
    if index == _DEFAULT_INDEX:
        try:
            data = _get_json(f"https://pypi.org/pypi/{name}/json", "application/json")
            files = [dict(f, filename=f.get("filename", "")) for fs in data.get("releases", {}).values() for f in fs]
            releases = _releases_from_files(files, "upload_time_iso_8601")
            if releases:
                return releases, "https://pypi.org/pypi (JSON API)"
        except Exception as exc:
            errors.append(f"pypi json: {type(exc).__name__}: {exc}")
    try:
        return _pip_index_versions(name), "pip index versions (no upload dates: " + "; ".join(errors) + ")"
    except Exception as exc:
        errors.append(str(exc))
        raise RuntimeError(f"cannot list releases of {name}: " + "; ".join(errors)) from exc


def newest(
    releases: Iterable[Release],
    *,
    now: dt.datetime,
    include_fresh: bool = False,
    spec: SpecifierSet | None = None,
) -> tuple[Release | None, list[str]]:
    """The newest final release (in ``spec``), skipping ones younger than :data:`FRESH_HOURS`.

    Returns it and notes on what was skipped as too fresh.
    """
    notes: list[str] = []
    candidates: list[tuple[Version, Release]] = []
    for r in releases:
        try:
            v = Version(r.version)
        except InvalidVersion:
            continue
        if v.is_prerelease or v.is_devrelease:
            continue
        if spec is not None and not spec.contains(v, prereleases=False):
            continue
        candidates.append((v, r))
    for _, r in sorted(candidates, key=lambda c: c[0], reverse=True):
        age = r.age_hours(now)
        if not include_fresh and age is not None and age < FRESH_HOURS:
            notes.append(f"ignored {r.version} (uploaded {age:.0f} h ago; --include-fresh checks it)")
            continue
        return r, notes
    return None, notes


# --------------------------------------------------------------------------------------------
# Layers and their metadata


@dataclass(frozen=True)
class Meta:
    name: str
    version: str
    requires: tuple[str, ...]


def layer_meta(path: Path, distribution: str) -> Meta:
    """Name, version and Requires-Dist of ``distribution`` as installed in a layer directory."""
    want = canonicalize_name(distribution)
    for meta in sorted(path.glob("*.dist-info/METADATA")):
        msg = email.parser.Parser().parsestr(meta.read_text(encoding="utf-8", errors="replace"), headersonly=True)
        if canonicalize_name(msg.get("Name", "")) == want:
            return Meta(want, msg.get("Version", ""), tuple(msg.get_all("Requires-Dist") or ()))
    raise LookupError(f"{distribution} is not installed in layer {path}")


def requirement_on(requires: Iterable[str], dependency: str) -> SpecifierSet | None:
    """The version range ``requires`` (Requires-Dist lines) puts on ``dependency`` on this platform.

    Markers are evaluated for this platform with no extra and with ``cpu`` (mlx-lm declares its
    Linux dependency as ``mlx[cpu]>=X; extra == "cpu"``); when none applies here, the macOS ones
    are used. ``None`` when ``dependency`` is not required at all.
    """
    want = canonicalize_name(dependency)
    reqs: list[Requirement] = []
    for text in requires:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if canonicalize_name(req.name) == want:
            reqs.append(req)
    if not reqs:
        return None
    env: dict[str, str] = {k: str(v) for k, v in default_environment().items()}
    for system in (env["platform_system"], "Darwin"):
        chosen = [
            r
            for r in reqs
            if r.marker is None
            or any(r.marker.evaluate({**env, "platform_system": system, "extra": e}) for e in ("", "cpu"))
        ]
        if chosen:
            return SpecifierSet(",".join(str(r.specifier) for r in chosen if str(r.specifier)))
    return None


def mlx_requirement(version: str) -> str:
    """The layer requirement for mlx ``version`` on this platform (CPU wheels on Linux)."""
    return f"mlx=={version}" if platform.system() == "Darwin" else f"mlx[cpu]=={version}"


# --------------------------------------------------------------------------------------------
# The child process


def _child_env(layers: Sequence[Path], verdicts: str) -> dict[str, str]:
    """The child's environment: the layers first on its path, kvpatch's switches of this process dropped, every patch
    enabled (``KVPATCH=off`` keeps the start-up hook out: the child builds its own engine), verdicts in ``verdicts``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPATCH") or k == envs.CACHE_VAR}
    here = str(Path(__file__).resolve().parent.parent)  # the directory that holds this kvpatch
    env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in layers), here])
    env.pop("PYTHONHOME", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    return env | {"KVPATCH": "off", "KVPATCH_VERDICTS": verdicts}


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(_MARK + json.dumps(record) + "\n")
    sys.stdout.flush()


def _missing_targets(patch: Patch) -> tuple[list[str], list[str], list[str]]:
    """(missing targets, ADD targets that already exist, missing third-party dependencies)."""
    import importlib

    missing: list[str] = []
    exists: list[str] = []
    deps: list[str] = []
    present = 0
    for t in patch.targets:
        try:
            owner: Any = importlib.import_module(t.module)
            for part in t.owner_path:
                owner = getattr(owner, part)
        except (ImportError, AttributeError) as exc:
            name = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
            if name and name.split(".")[0] not in DISTRIBUTIONS.values():
                # Not the target missing: this interpreter lacks something upstream imports.
                deps.append(f"importing {t.module}: {type(exc).__name__}: {exc}")
            elif not t.optional:
                missing.append(f"{t.path} ({type(exc).__name__}: {exc})")
            continue
        has = hasattr(owner, t.attribute)
        if t.kind is Kind.ADD:
            present += 1
            if has:
                exists.append(t.path)
        elif has:
            present += 1
        elif not t.optional:
            missing.append(f"{t.path} (not found)")
    if present == 0 and not missing and not deps and patch.targets:
        missing.append("every target is absent (all optional)")
    return missing, exists, sorted(set(deps))


def _finding(finding: Finding | None) -> dict[str, Any] | None:
    keys = ("present", "detail", "skipped", "inconclusive")
    return None if finding is None else {k: getattr(finding, k) for k in keys}


def child_main(argv: Sequence[str]) -> int:
    """Run in the child: ``argv[0]`` is JSON ``{"ids": [...], "with": bool}``. Upstream's targets are looked up as
    released; then, with an engine that has every patch enabled, kvpatch's one measurement runs each reproduction
    without the patch and with it as kvpatch leaves it (:meth:`kvpatch.engine.Engine.measure`), after a
    :class:`kvpatch.verifier.Verifier` settled (``with``) the patches whose reproduction decides them here."""
    from importlib import metadata

    from ..config import Config
    from ..engine import Engine
    from ..registry import load
    from ..verifier import Verifier

    spec = json.loads(argv[0])
    Verifier.begin()  # on the CPU from before upstream is imported, as kvpatch verify
    versions: dict[str, str | None] = {}
    for dist in ("mlx", "mlx-lm", "mlx-vlm"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    _emit({"kind": "env", "versions": versions, "executable": sys.executable})
    reg = load()
    patches = [p for p in reg.patches if p.id in spec["ids"]]
    looked = {p.id: _missing_targets(p) for p in patches}  # as released: before kvpatch changes anything
    engine = Engine(reg.patches, config=Config(enable_all=True))
    engine.activate()
    if spec["with"]:
        Verifier(engine, "upstream-check").run(patches)
    for patch in patches:
        out: dict[str, Any] = {"kind": "patch", "id": patch.id, "missing": [], "exists": [], "deps": []}
        started = time.monotonic()
        try:
            out["missing"], out["exists"], out["deps"] = looked[patch.id]
            st = engine.status[patch.id]
            try:
                measured = st.measurement or engine.measure(patch, install=False)
                before, after = measured.before, measured.after
            except ImportError as exc:  # a target module that does not import: as a reproduction importing it finds
                before, after = Finding.from_error(exc), None
            # with the patch as kvpatch leaves it here: where it is not installed, the run without it
            out["finding"], out["with"] = _finding(before), _finding(after or before)
            out["state"], out["reason"] = st.state.value, st.reason
        except BaseException as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["traceback"] = traceback.format_exc(limit=6)[-2000:]
        out["seconds"] = round(time.monotonic() - started, 3)
        _emit(out)
    return 0


_CHILD_CODE = "import sys; from kvpatch.maint.upstream_check import child_main; sys.exit(child_main(sys.argv[1:]))"


@dataclass
class ChildRun:
    versions: dict[str, str | None] = field(default_factory=dict)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    failure: str | None = None  # why the child did not report every patch


def run_child(layers: Sequence[Path], ids: Sequence[str], *, patched: bool = True, timeout: float) -> ChildRun:
    """Measure ``ids`` in a child over ``layers``: each without its patch and, with ``patched``, with it."""
    run = ChildRun()
    cwd = envs.cache_dir()
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", _CHILD_CODE, json.dumps({"ids": list(ids), "with": patched})]
    try:
        with tempfile.TemporaryDirectory(prefix="kvpatch-upstream-check-") as verdicts:
            env = _child_env(layers, verdicts)
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        code = None
    for line in stdout.splitlines():
        if not line.startswith(_MARK):
            continue
        record = json.loads(line[len(_MARK) :])
        if record["kind"] == "env":
            run.versions = record["versions"]
        else:
            run.results[record["id"]] = record
    if len(run.results) < len(ids):
        tail = envs._tail(stderr, 8)
        how = f"timed out after {timeout:.0f} s" if code is None else f"exited with status {code}"
        run.failure = f"the child process {how}" + (f": {tail}" if tail else "")
    return run


# --------------------------------------------------------------------------------------------
# Planning the environments


@dataclass
class Checked:
    """One upstream distribution under check."""

    distribution: str
    requirement: str  # a layer requirement: "mlx-lm==0.32.2" or a path
    how: str  # "newest", "pinned", "local"
    uploaded: dt.datetime | None = None
    meta: Meta | None = None
    layer: Path | None = None

    @property
    def local(self) -> bool:
        return self.how == "local"


@dataclass
class Env:
    checks: tuple[str, ...]  # distributions whose patches are judged here
    requirements: list[str]  # layer requirements in PYTHONPATH order
    versions: dict[str, str]
    layers: list[Path] = field(default_factory=list)

    def describe(self) -> str:
        return ", ".join(self.requirements)


class CheckError(RuntimeError):
    """The check could not be set up (no release found, a layer failed to build)."""


class Planner:
    def __init__(self, *, include_fresh: bool, now: dt.datetime) -> None:
        self.include_fresh = include_fresh
        self.now = now
        self._releases: dict[str, tuple[list[Release], str]] = {}
        self.notes: list[str] = []

    def releases(self, name: str) -> list[Release]:
        if name not in self._releases:
            self._releases[name] = index_releases(name)
            source = self._releases[name][1]
            if "no upload dates" in source:
                self.notes.append(f"{name}: {source}: the {FRESH_HOURS}-hour rule is not applied")
        return self._releases[name][0]

    def newest(self, name: str, spec: SpecifierSet | None = None) -> Release:
        release, notes = newest(self.releases(name), now=self.now, include_fresh=self.include_fresh, spec=spec)
        self.notes.extend(f"{name}: {n}" for n in notes)
        if release is None:
            raise CheckError(f"no release of {name} on the index satisfies {spec or 'any version'}")
        return release

    def target(self, distribution: str, given: str | None) -> Checked:
        if given is None or given == "newest":
            r = self.newest(distribution)
            t = Checked(distribution, f"{distribution}=={r.version}", "newest", r.uploaded)
        elif envs._looks_like_path(given):
            t = Checked(distribution, str(Path(given).expanduser().resolve()), "local")
        else:
            try:
                Version(given)
            except InvalidVersion as exc:
                raise CheckError(f"--{distribution} {given!r}: not a version, wheel or source tree") from exc
            uploaded = next((r.uploaded for r in self.releases(distribution) if r.version == given), None)
            t = Checked(distribution, f"{distribution}=={given}", "pinned", uploaded)
        t.layer = _layer(t.requirement)
        t.meta = layer_meta(t.layer, distribution)
        return t

    def mlx_for(self, metas: Iterable[Meta]) -> str:
        specs = [s for s in (requirement_on(m.requires, "mlx") for m in metas) if s is not None]
        combined = SpecifierSet(",".join(str(s) for s in specs if str(s))) if specs else None
        return self.newest("mlx", combined).version

    def plan(self, lm: Checked | None, vlm: Checked | None, extra: Sequence[str]) -> list[Env]:
        out: list[Env] = []
        if vlm is not None:
            assert vlm.meta is not None
            want = requirement_on(vlm.meta.requires, "mlx-lm")
            companion = lm
            if lm is not None and lm.meta is not None and want is not None and not want.contains(lm.meta.version, True):
                companion = None  # the checked mlx-lm does not fit this mlx-vlm: separate environments
            if companion is None:
                r = self.newest("mlx-lm", want)
                companion = Checked("mlx-lm", f"mlx-lm=={r.version}", "companion", r.uploaded)
                companion.layer = _layer(companion.requirement)
                companion.meta = layer_meta(companion.layer, "mlx-lm")
            metas = [m for m in (vlm.meta, companion.meta) if m is not None]
            try:
                mlx = self.mlx_for(metas)
            except CheckError:
                if companion is not lm:
                    raise
                # No mlx fits both: check mlx-vlm with its own mlx-lm, and mlx-lm on its own.
                return self.plan(None, vlm, extra) + self.plan(lm, None, extra)
            checks = ("mlx-lm", "mlx-vlm") if companion is lm else ("mlx-vlm",)
            out.append(self._env(checks, mlx, [companion, vlm], extra))
            if companion is not lm and lm is not None:
                out.extend(self.plan(lm, None, extra))
            return out
        if lm is not None:
            assert lm.meta is not None
            out.append(self._env(("mlx-lm",), self.mlx_for([lm.meta]), [lm], extra))
        return out

    def _env(self, checks: tuple[str, ...], mlx: str, targets: Sequence[Checked | None], extra: Sequence[str]) -> Env:
        reqs = [mlx_requirement(mlx)]
        versions = {"mlx": mlx}
        layers = [_layer(reqs[0])]
        for t in targets:
            if t is None:
                continue
            assert t.meta is not None and t.layer is not None
            reqs.append(t.requirement)
            versions[t.distribution] = t.meta.version
            layers.append(t.layer)
        for e in extra:
            reqs.append(e)
            layers.append(_layer(e))
        return Env(checks, reqs, versions, layers)


def _layer(requirement: str) -> Path:
    try:
        return envs.layer(requirement)
    except envs.EnvBuildError as exc:
        raise CheckError(str(exc)) from exc


# --------------------------------------------------------------------------------------------
# Measuring


@dataclass
class Row:
    patch: Patch
    release: str | None
    env: str
    measured: Measured
    detail: str = ""
    first_fixed: str | None = None
    patched: str | None = None  # what the kvpatch-active child saw
    agreement: Agreement | None = None
    seconds: float | None = None
    skipped: bool = False  # the reproduction said it cannot run here
    fixes: bool | None = None  # whether the patch removed the bug (kvpatch-active child)

    @property
    def measured_text(self) -> str:
        if self.measured is Measured.FIXED:
            return f"fixed upstream in {self.first_fixed or self.release}"
        return self.measured.value

    def as_json(self) -> dict[str, Any]:
        p = self.patch
        v = self.agreement
        return {
            "id": p.id,
            "file": patch_file(p),
            "distribution": p.distribution,
            "release": self.release,
            "environment": self.env,
            "measured": self.measured.value,
            "measured_text": self.measured_text,
            "first_fixed": self.first_fixed,
            "detail": self.detail,
            "with_patch": self.patched,
            "record": {"affected": p.affected, "fixed_in": p.fixed_in, "checked_through": p.checked_through},
            "expected": v.expected if v else None,
            "agrees": v.agrees if v else None,
            "advice": list(v.advice) if v else [],
            "seconds": self.seconds,
        }


def _measure_one(result: dict[str, Any] | None, failure: str | None) -> tuple[Measured, str, bool]:
    """(measured, detail, skipped) from one child result."""
    if result is None:
        return Measured.COULD_NOT_RUN, failure or "no result", False
    missing = result.get("missing") or []
    exists = result.get("exists") or []
    if result.get("deps"):
        return (
            Measured.COULD_NOT_RUN,
            f"this interpreter lacks a dependency of the upstream release ({'; '.join(result['deps'])}): "
            "install it here; the reproduction's finding is not trusted",
            False,
        )
    if "error" in result:
        if missing:
            return Measured.MOVED, f"missing: {'; '.join(missing)}; reproduction raised {result['error']}", False
        return Measured.COULD_NOT_RUN, f"reproduction raised {result['error']}", False
    finding = result["finding"]
    if finding["skipped"]:
        return Measured.COULD_NOT_RUN, f"skipped: {finding['skipped']}", True
    if finding.get("inconclusive"):
        return Measured.INCONCLUSIVE, f"inconclusive: {finding['inconclusive']}", False
    if not finding["present"]:
        note = f" (targets: {'; '.join(missing)})" if missing else ""
        return Measured.FIXED, f"{finding['detail']}{note}", False
    if missing or exists:
        what = [*(f"missing {m}" for m in missing), *(f"{e} already exists upstream (cannot add)" for e in exists)]
        return Measured.MOVED, f"bug present ({finding['detail']}); {'; '.join(what)}", False
    return Measured.NEEDED, finding["detail"], False


def _patched_text(result: dict[str, Any] | None, failure: str | None) -> tuple[str, bool | None]:
    """What the run with the patch, as kvpatch leaves it, says: (text, whether the patch removed the bug)."""
    if result is None:
        return f"could not run: {failure or 'no result'}", None
    if result.get("deps"):
        return f"could not run: missing dependency: {'; '.join(result['deps'])}", None
    if "error" in result:
        return f"could not run: {result['error']}", None  # no finding: never advice to rework the patch
    finding = result["with"]
    state = result.get("state", "?")
    if finding["skipped"]:
        return f"{state}; skipped: {finding['skipped']}", None
    if finding.get("inconclusive"):
        return f"{state}; inconclusive with kvpatch active: {finding['inconclusive']}", None
    if finding["present"]:
        return f"{state}; bug still present with kvpatch active", False
    return f"{state}; bug fixed by the patch", True


@dataclass
class Options:
    mlx_lm: str | None = None
    mlx_vlm: str | None = None
    include_fresh: bool = False
    layers: tuple[str, ...] = ()
    timeout: float = 900.0
    bisect: bool = True
    now: dt.datetime | None = None


@dataclass
class Outcome:
    targets: list[Checked]
    envs: list[Env]
    rows: list[Row]
    notes: list[str]
    seconds: float

    @property
    def exit_code(self) -> int:
        return 1 if any(r.agreement is not None and r.agreement.agrees is False for r in self.rows) else 0


def check(patches: Sequence[Patch], options: Options) -> Outcome:
    started = time.monotonic()
    now = options.now or dt.datetime.now(dt.timezone.utc)
    planner = Planner(include_fresh=options.include_fresh, now=now)
    lm = None if options.mlx_lm == "none" else planner.target("mlx-lm", options.mlx_lm)
    vlm = None if options.mlx_vlm == "none" else planner.target("mlx-vlm", options.mlx_vlm)
    targets = [t for t in (lm, vlm) if t is not None]
    if not targets:
        raise CheckError("nothing to check (--mlx-lm none --mlx-vlm none)")
    local = {t.distribution: t.local for t in targets}
    planned = planner.plan(lm, vlm, options.layers)
    rows: list[Row] = []
    judged: set[str] = set()
    for env in planned:
        mine = [p for p in patches if p.distribution in env.checks and p.id not in judged]
        judged.update(p.id for p in mine)
        relevant_ids = [p.id for p in mine if relevant(p, env.versions)]
        run = run_child(env.layers, relevant_ids, timeout=options.timeout) if relevant_ids else ChildRun()
        mismatch = [
            f"{d} {run.versions.get(d)} (wanted {v})"
            for d, v in env.versions.items()
            if relevant_ids and run.versions and run.versions.get(d) != v
        ]
        needed: list[str] = []
        for p in mine:
            release = env.versions.get(p.distribution)
            if p.id not in relevant_ids:
                rows.append(Row(p, release, env.describe(), Measured.NOT_RELEVANT, _why_not_relevant(p, release)))
                continue
            result = run.results.get(p.id)
            if mismatch:
                measured, detail, skipped = Measured.COULD_NOT_RUN, "child sees " + ", ".join(mismatch), False
            else:
                measured, detail, skipped = _measure_one(result, run.failure)
            row = Row(p, release, env.describe(), measured, detail, seconds=(result or {}).get("seconds"))
            row.skipped = skipped
            rows.append(row)
            if measured is Measured.NEEDED:
                needed.append(p.id)
        for row in rows:
            if row.patch.id in needed:
                row.patched, row.fixes = _patched_text(run.results.get(row.patch.id), run.failure)
    for row in rows:
        p = row.patch
        if row.measured is Measured.NOT_RELEVANT or row.release is None:
            row.agreement = Agreement(None, Expect.NOT_RELEVANT.value)
            continue
        is_local = local.get(p.distribution, False)
        if (
            row.measured is Measured.FIXED
            and options.bisect
            and not is_local
            and expectation(p, row.release) in (Expect.NEWER, Expect.NEEDED)
        ):
            row.first_fixed = _bisect(planner, p, row.release, options)
        row.agreement = judge(
            p,
            row.release,
            row.measured,
            first_fixed=row.first_fixed,
            patched_fixes=row.fixes,
            patched_state=row.patched,
            skipped=row.skipped,
            local=is_local,
        )
    return Outcome(targets, planned, rows, planner.notes, time.monotonic() - started)


def _why_not_relevant(p: Patch, release: str | None) -> str:
    if release is None:
        return f"{p.distribution} not checked"
    if _below(p, Version(release)):
        return f"{release} predates {p.affected}"
    return f"range ended: fixed in {p.fixed_in}"


def _bisect(planner: Planner, patch: Patch, release: str, options: Options) -> str | None:
    """The first release in (checked_through, release] without the bug (releases assumed monotonic)."""
    start = patch.checked_through or None
    lo = Version(start) if start else None
    hi = Version(release)
    candidates = sorted(
        {
            Version(r.version)
            for r in planner.releases(patch.distribution)
            if _final(r.version) and (lo is None or Version(r.version) > lo) and Version(r.version) < hi
        }
    )
    if lo is None:
        candidates = [v for v in candidates if patch.range.contains(v, prereleases=True)]
    first = str(hi)
    while candidates:
        mid = candidates[len(candidates) // 2]
        present = _probe(planner, patch, str(mid), options)
        if present is None:
            planner.notes.append(f"{patch.id}: bisect stopped at {mid} (could not run there)")
            return f"<={first}"
        if present:
            candidates = [v for v in candidates if v > mid]
        else:
            first = str(mid)
            candidates = [v for v in candidates if v < mid]
    return first


def _final(version: str) -> bool:
    try:
        v = Version(version)
    except InvalidVersion:
        return False
    return not (v.is_prerelease or v.is_devrelease)


def _probe(planner: Planner, patch: Patch, version: str, options: Options) -> bool | None:
    target = Checked(patch.distribution, f"{patch.distribution}=={version}", "pinned")
    try:
        target.layer = _layer(target.requirement)
        target.meta = layer_meta(target.layer, patch.distribution)
        if patch.distribution == "mlx-lm":
            env = planner.plan(target, None, options.layers)[0]
        else:
            env = planner.plan(None, target, options.layers)[0]
    except Exception as exc:
        planner.notes.append(f"{patch.id}: cannot probe {patch.distribution} {version}: {exc}")
        return None
    run = run_child(env.layers, [patch.id], patched=False, timeout=options.timeout)
    measured, _, _ = _measure_one(run.results.get(patch.id), run.failure)
    planner.notes.append(f"{patch.id}: bisect {patch.distribution} {version}: {measured.value}")
    if measured is Measured.NEEDED:
        return True
    if measured is Measured.FIXED:
        return False
    return None


# --------------------------------------------------------------------------------------------
# Output


def as_json(outcome: Outcome) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "python": platform.python_version(),
        "platform": sys.platform,
        "cache": str(envs.cache_dir()),
        "checked": [
            {
                "distribution": t.distribution,
                "version": t.meta.version if t.meta else None,
                "how": t.how,
                "requirement": t.requirement,
                "uploaded": t.uploaded.isoformat() if t.uploaded else None,
            }
            for t in outcome.targets
        ],
        "environments": [
            {"checks": list(e.checks), "layers": e.requirements, "versions": e.versions} for e in outcome.envs
        ],
        "patches": [r.as_json() for r in outcome.rows],
        "notes": outcome.notes,
        "seconds": round(outcome.seconds, 1),
        "exit": outcome.exit_code,
    }


def format_text(outcome: Outcome) -> str:
    lines = []
    for t in outcome.targets:
        assert t.meta is not None
        when = f", uploaded {t.uploaded:%Y-%m-%d}" if t.uploaded else ""
        src = f" from {t.requirement}" if t.local else ""
        lines.append(f"checked {t.distribution} {t.meta.version} ({t.how}{when}){src}")
    for e in outcome.envs:
        lines.append(f"environment [{', '.join(e.checks)}]: {e.describe()} over {sys.executable}")
    lines.append("")
    header = ("patch", "release", "measured", "record expects", "verdict")
    data = []
    for r in outcome.rows:
        v = r.agreement
        verdict = "-" if v is None or v.agrees is None else ("agrees" if v.agrees else "DISAGREES")
        release = f"{r.patch.distribution} {r.release}" if r.release else r.patch.distribution
        data.append((r.patch.id, release, r.measured_text, v.expected if v else "", verdict))
    widths = [max(len(str(row[i])) for row in [header, *data]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines.append(fmt.format(*header).rstrip())
    for r, row in zip(outcome.rows, data, strict=True):
        lines.append(fmt.format(*row).rstrip())
        if r.measured is not Measured.NOT_RELEVANT and r.detail:
            lines.append(f"    measured: {r.detail}")
        elif r.measured is Measured.NOT_RELEVANT:
            lines.append(f"    {r.detail}")
        if r.patched:
            lines.append(f"    with kvpatch active: {r.patched}")
    for note in outcome.notes:
        lines.append(f"note: {note}")
    failed = [r for r in outcome.rows if r.agreement and r.agreement.agrees is False]
    unsettled = (Measured.COULD_NOT_RUN, Measured.INCONCLUSIVE)
    unmeasured = [r for r in failed if r.measured in unsettled]
    must = [(r, a) for r in failed if r.agreement and r.measured not in unsettled for a in r.agreement.advice]
    may = [(r, a) for r in outcome.rows if r.agreement and r.agreement.agrees is True for a in r.agreement.advice]
    lines.append("")
    if must:
        lines.append(
            "records that disagree with what was measured (change them, then `python -m kvpatch.maint.regenerate`):"
        )
        lines.extend(f"  - {a}" for _, a in must)
    if unmeasured:
        lines.append("could not measure: inconclusive or could not run (not record errors; fix the environment or")
        lines.append("the reproduction, then re-run):")
        lines.extend(f"  - {patch_file(r.patch)}: {r.detail}" for r in unmeasured)
    if may:
        lines.append("records to bring up to date (they agree; the newer release was measured):")
        lines.extend(f"  - {a}" for _, a in may)
    n = sum(1 for r in outcome.rows if r.agreement and r.agreement.agrees is not None and r not in unmeasured)
    lines.append(
        f"upstream-check: {len(outcome.rows)} patches, {n} measured, "
        + (
            "every record agrees (exit 0)"
            if outcome.exit_code == 0
            else f"{len(failed) - len(unmeasured)} disagree, {len(unmeasured)} could not be measured (exit 1)"
        )
        + f" in {outcome.seconds:.0f} s"
    )
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    """Register ``upstream-check`` on the CLI's subparsers."""
    p = sub.add_parser(
        "upstream-check",
        help="run every reproduction (without the patch) on the newest upstream releases; compare with the records",
    )
    p.add_argument(
        "--mlx-lm", metavar="VERSION|PATH|none", help="release, local wheel or source tree (default: newest)"
    )
    p.add_argument(
        "--mlx-vlm", metavar="VERSION|PATH|none", help="release, local wheel or source tree (default: newest)"
    )
    p.add_argument("--include-fresh", action="store_true", help=f"also consider releases younger than {FRESH_HOURS} h")
    p.add_argument("--layer", action="append", default=[], metavar="REQ", help="extra layer, e.g. transformers==4.57.6")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per child process (default 900)")
    p.add_argument("--no-bisect", action="store_true", help="do not look for the first fixed release")
    p.add_argument("--json", action="store_true", help=f"machine-readable output (schema {SCHEMA})")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from ..registry import load

    options = Options(
        mlx_lm=args.mlx_lm,
        mlx_vlm=args.mlx_vlm,
        include_fresh=args.include_fresh,
        layers=tuple(args.layer),
        timeout=args.timeout,
        bisect=not args.no_bisect,
    )
    reg = load()
    try:
        outcome = check(reg.patches, options)
    except (CheckError, RuntimeError) as exc:
        if args.json:
            print(json.dumps({"schema": SCHEMA, "error": str(exc), "exit": 1}, indent=2))
        else:
            print(f"upstream-check could not run: {exc}", file=sys.stderr)
        return 1
    for module, error in reg.broken.items():
        outcome.notes.append(f"patch module {module} could not be loaded: {error}")
    if args.json:
        print(json.dumps(as_json(outcome), indent=2))
    else:
        print(format_text(outcome))
    return 1 if reg.broken else outcome.exit_code
