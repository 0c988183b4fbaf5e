"""Attribution: what kvpatch has to do with a finding, measured by running its reproduction in child processes of
the finding's bucket with kvpatch off, on, and on with candidate patches disabled.

``fixed by <patch id>``  gone with kvpatch on, back with that one patch disabled;
``fixed by <a> and <b> (each alone)``  gone with kvpatch on, back only with those candidates disabled together
                         (patches that overlap: each alone removes it);
``fixed by kvpatch``     gone with kvpatch on, back only with every candidate disabled;
``new``                  there with kvpatch on: nothing in kvpatch covers it;
``intended``             there with kvpatch on, and documented upstream behaviour (:mod:`.intended`);
``with kvpatch only: <patch id>``  found by the kvpatch-on hunt, absent from upstream alone: that patch brings it
                         (kvpatch's own bug, or upstream behaviour a patch newly exposes);
``not reproduced``       its reproduction passes where it was found (a flaky finding: reported, never patched).

The candidates are read from the registry: the patches applicable to the bucket's release whose targets live in a
module the reproduction imports, on a class it names (or on a module-level function there). No patch is named in
this code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.version import Version

from ...record import Patch
from . import intended

TIMEOUT = 300.0


@dataclass(frozen=True)
class Run:
    present: bool | None  # the finding's failure; None: it failed some other way (the text says how)
    text: str


def imported(script: str) -> dict[str, set[str]]:
    """Upstream modules the script imports from, and the names it takes from each."""
    out: dict[str, set[str]] = {}
    for module, names in re.findall(r"^from (mlx_(?:lm|vlm)[\w.]*) import (.+)$", script, flags=re.M):
        out.setdefault(module, set()).update(n.strip() for n in names.split(","))
    return out


def candidates(
    script: str, patches: list[Patch], releases: Mapping[str, str | None], whole: tuple[str, ...] = ()
) -> list[str]:
    """Patches applicable to ``releases`` with a target the script reaches (see the module's docstring); every target
    in a ``whole`` module counts (a model's forward pass reaches all of its module, its caches and its attention)."""
    modules = imported(script)
    for module in whole:
        modules[module] = {"*"}
    out = []
    for patch in patches:
        release = releases.get(patch.distribution)
        if release is None or not patch.range.contains(Version(release), prereleases=True):
            continue
        for target in patch.targets:
            names = modules.get(target.module)
            if names is None:
                continue
            owner = target.owner_path[0] if target.owner_path else None
            if owner is None or owner in names or "*" in names:
                out.append(patch.id)
                break
    return out


def run(script: str, env: Mapping[str, str], *, expected: str, kvpatch: str, disable: tuple[str, ...] = ()) -> Run:
    """Run the reproduction once; ``expected``: the exception type its failure raises."""
    child = {k: v for k, v in env.items() if not k.startswith("KVPATCH") or k in ("KVPATCH_CACHE", "KVPATCH_BUCKET")}
    child["KVPATCH_VERIFY"] = "never"
    if kvpatch == "off":
        child["KVPATCH"] = "off"
    if disable:
        child["KVPATCH_DISABLE"] = ",".join(disable)
    child["PYTHONDONTWRITEBYTECODE"] = "1"
    with tempfile.TemporaryDirectory(prefix="kvpatch-hunt-") as cwd:
        path = Path(cwd) / "reproduction.py"
        path.write_text(script, encoding="utf-8")
        try:
            proc = subprocess.run(
                [sys.executable, "-P", str(path)], cwd=cwd, env=child, capture_output=True, text=True, timeout=TIMEOUT
            )
        except subprocess.TimeoutExpired:
            return Run(None, f"timed out after {TIMEOUT:.0f} s")
    if proc.returncode == 0:
        return Run(False, (proc.stdout.strip().splitlines() or [""])[-1])
    raised = [line for line in proc.stderr.splitlines() if _RAISED.match(line)]
    last = raised[-1] if raised else (proc.stderr.strip().splitlines() or [""])[-1]
    kind = last.split(":", 1)[0].strip().rsplit(".", 1)[-1]
    return Run(True, last) if kind == expected else Run(None, last)


#: A traceback's closing line: the exception's (dotted) type, a colon (a message may span more lines after it).
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b(:|$)")


@dataclass
class Attribution:
    verdict: str  # "fixed by <id>", "fixed by kvpatch (...)", "new", "intended", "not reproduced", "inconclusive"
    off: str
    on: str
    candidates: list[str]
    reference: str | None = None  # for "intended": where upstream documents it

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}


def attribute(
    finding: dict[str, Any], env: Mapping[str, str], patches: list[Patch], releases: Mapping[str, str | None]
) -> Attribution:
    """Attribute one finding (a record the in-bucket hunt emitted)."""
    script = finding["script"]
    expected = finding.get("error") or "AssertionError"
    names = candidates(script, patches, releases, tuple(finding.get("modules") or ()))
    off = run(script, env, expected=expected, kvpatch="off")
    if off.present is False and "on" in finding.get("hunts", ()):
        return _with_kvpatch_only(script, env, expected, names, off)
    if off.present is not True:
        verdict = "not reproduced" if off.present is False else "inconclusive"
        return Attribution(verdict, off.text, "", names)
    # found by the kvpatch-on hunt: present with kvpatch on, as measured there (one child process less)
    found_on = "on" in finding.get("hunts", ())
    on = (
        Run(True, "found by the hunt with kvpatch on")
        if found_on
        else run(script, env, expected=expected, kvpatch="on")
    )
    if on.present is True:
        documented = intended.match(finding)
        if documented is not None:
            return Attribution("intended", off.text, on.text, names, documented)
        return Attribution("new", off.text, on.text, names)
    # With kvpatch on the reproduction passes, or fails another way: its own failure is gone (what a patch fixed);
    # what remains is said with the verdict (the hunt's other findings tell what it is).
    remains = f" (with kvpatch on it then fails otherwise: {on.text})" if on.present is None else ""

    def back(disabled: list[str]) -> bool:
        return run(script, env, expected=expected, kvpatch="on", disable=tuple(disabled)).present is True

    if not names or not back(names):
        return Attribution(f"fixed by kvpatch (no single candidate brings it back){remains}", off.text, on.text, names)
    group = list(names)
    while len(group) > 1:
        half = group[: len(group) // 2]
        group = half if back(half) else group[len(group) // 2 :]
    if len(names) == 1 or back(group):
        return Attribution(f"fixed by {group[0]}{remains}", off.text, on.text, names)
    # No one patch brings it back: patches that overlap (each alone fixes it). The smallest set found by dropping
    # each candidate in turn while the failure still comes back names them; each is credited with the fix.
    needed = list(names)
    for name in names:
        if len(needed) > 1 and back([n for n in needed if n != name]):
            needed.remove(name)
    if len(needed) < len(names):
        return Attribution(f"fixed by {' and '.join(needed)} (each alone){remains}", off.text, on.text, names)
    return Attribution(f"fixed by kvpatch (several of {', '.join(names)}){remains}", off.text, on.text, names)


def _with_kvpatch_only(script: str, env: Mapping[str, str], expected: str, names: list[str], off: Run) -> Attribution:
    """A finding of the kvpatch-on hunt that upstream alone does not have: which patch brings it (the one whose
    removal makes it go; a patch that makes an operation available exposes what that operation then does)."""
    on = run(script, env, expected=expected, kvpatch="on")
    if on.present is not True:
        return Attribution("not reproduced", off.text, on.text, names)

    def gone(disabled: list[str]) -> bool:
        return run(script, env, expected=expected, kvpatch="on", disable=tuple(disabled)).present is False

    if not names or not gone(names):
        return Attribution("with kvpatch only (no single candidate)", off.text, on.text, names)
    group = list(names)
    while len(group) > 1:
        half = group[: len(group) // 2]
        group = half if gone(half) else group[len(group) // 2 :]
    return Attribution(f"with kvpatch only: {group[0]}", off.text, on.text, names)


def fixed_by(verdict: str) -> list[str]:
    """The patches a verdict credits with the fix (none for ``fixed by kvpatch (...)`` and every other verdict)."""
    m = re.match(r"fixed by ([\w-]+(?: and [\w-]+)*)(?: \(each alone\))?(?: \(with kvpatch on|$)", verdict)
    return [] if m is None or m.group(1) == "kvpatch" else m.group(1).split(" and ")


def environ(bucket: Any) -> dict[str, str]:
    from ..envs import bucket_environ

    return bucket_environ(bucket, base=dict(os.environ))
