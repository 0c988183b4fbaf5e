"""Print what kvpatch promises in one environment, normalised so that two runs can be diffed.

    .venv/bin/python scripts/in_bucket.py lm-0.32.2 -- python scripts/snapshot_behaviour.py > before.txt

Each part runs in a fresh child process with empty, private verdict and state folders (nothing of the
machine's caches is read or written) and no background verification:

1. ``kvpatch status --json`` (no verdicts yet),
2. ``records()`` after importing every target module,
3. ``kvpatch verify --json``,
4. ``kvpatch status --json`` and ``records()`` again, with the verdicts ``verify`` stored;

with ``--verify``, only ``kvpatch status --verify --json`` (every relevant reproduction, without and with
its patch: slow). ``--archive`` makes mlx-lm and mlx-vlm read as archive installs (a wheel-file install, as on the
GPU host: every patch in range is then decided by its reproduction, and ``verify`` measures each).

Timestamps, process ids and temporary paths are replaced by placeholders; nothing else is dropped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata

RECORDS = r"""
import importlib, json, kvpatch
for r in kvpatch.records():
    for m in r.patch.modules:
        try:
            importlib.import_module(m)
        except Exception:
            pass
rows = [
    (r.patch.id, r.state.value, r.reason, r.error, r.verified, list(r.drift), list(r.notes),
     sorted(t.path for t in r.installed), list(r.wrapped), list(r.foreign))
    for r in kvpatch.records()
]
print(json.dumps(rows, indent=1))
"""

_VARYING = [
    (re.compile(r"\(verdict of [^,)]*"), "(verdict of <when>"),
    (re.compile(r"pid \d+"), "pid <pid>"),
    (re.compile(r"started at \d\d:\d\d"), "started at <hh:mm>"),
]


def _normalise(text: str, tmp: str) -> str:
    text = text.replace(tmp, "<tmp>")
    for pattern, replacement in _VARYING:
        text = pattern.sub(replacement, text)
    return text


def archive_overlay(tmp: str) -> str:
    """A folder holding copies of mlx-lm's and mlx-vlm's metadata with an archive ``direct_url.json``, to put first on
    a child's path: :mod:`kvpatch.detect` then reads them as archive installs (the code stays the layers')."""
    overlay = os.path.join(tmp, "overlay")
    os.makedirs(overlay)
    for name in ("mlx-lm", "mlx-vlm"):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        info = getattr(dist, "_path", None)  # the .dist-info folder of a path distribution
        if info is None:
            continue
        target = os.path.join(overlay, os.path.basename(str(info)))
        shutil.copytree(str(info), target)
        with open(os.path.join(target, "direct_url.json"), "w", encoding="utf-8") as f:
            json.dump({"url": f"file:///wheels/{name}.whl", "archive_info": {}}, f)
    return overlay


def _run(args: list[str], env: dict[str, str], tmp: str) -> str:
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, cwd=tmp, check=False)
    out = proc.stdout
    try:
        data = json.loads(out)
    except ValueError:
        return _normalise(f"exit {proc.returncode}\n{out}\n{proc.stderr[-2000:]}", tmp)
    if isinstance(data, dict):
        if data.get("settled"):
            data["settled"]["at"] = "<at>"
        if "cache" in data:
            data["cache"] = "<cache>"
    return _normalise(f"exit {proc.returncode}\n{json.dumps(data, indent=1, sort_keys=True)}", tmp)


def private_env(tmp: str, archive: bool) -> dict[str, str]:
    """This environment with empty verdict and state folders under ``tmp``, no background verification, no warnings
    (and, with ``archive``, mlx-lm and mlx-vlm read as archive installs: :func:`archive_overlay`)."""
    env = dict(os.environ)
    env.update(
        KVPATCH_VERDICTS=os.path.join(tmp, "verdicts"),
        KVPATCH_CACHE=os.path.join(tmp, "cache"),
        KVPATCH_VERIFY="never",
        PYTHONWARNINGS="ignore",
    )
    if archive:
        env["PYTHONPATH"] = os.pathsep.join([archive_overlay(tmp), env.get("PYTHONPATH", "")])
    return env


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvpatch-snap-") as tmp:
        env = private_env(tmp, "--archive" in sys.argv[1:])
        verify = [("status --verify --json", ["-m", "kvpatch", "status", "--verify", "--json", "--fresh"])]
        parts = (
            verify
            if "--verify" in sys.argv[1:]
            else [
                ("status --json (no verdicts)", ["-m", "kvpatch", "status", "--json", "--fresh"]),
                ("records() (no verdicts)", ["-c", RECORDS]),
                ("verify --json", ["-m", "kvpatch", "verify", "--json"]),
                ("status --json (verdicts stored)", ["-m", "kvpatch", "status", "--json", "--fresh"]),
                ("records() (verdicts stored)", ["-c", RECORDS]),
            ]
        )
        for title, args in parts:
            print(f"===== {title}")
            print(_run(args, env, tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
