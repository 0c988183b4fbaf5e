"""Count the module hops of ``kvpatch verify``: how often the path moves from one kvpatch module to another.

    .venv/bin/python scripts/in_bucket.py vlm-0.7.10 -- python scripts/count_hops.py [--archive]

A hop is a Python call or return whose frame belongs to a kvpatch runtime module other than the one of the
previous kvpatch runtime frame (frames of other code, and of the patch units in ``kvpatch.patches``, are looked
through; module bodies run by an import are not counted). Two fresh processes, each with empty private verdict and
state folders and no background verification, run the command line's ``verify --json``:

1. ``verify`` measures every patch whose outcome the reproduction decides (``N`` verified patches);
2. ``verify --missing`` afterwards finds every verdict stored and measures nothing.

The second is the fixed part; ``(first - second) / N`` the part per verified patch. Each is counted twice: over
every runtime module, and over the flow alone, with the leaf modules (records, warnings, files, configuration,
detection, fingerprints, the import bootstrap, whose calls every path makes) looked through as other code is.
``--archive`` makes the upstream distributions read as archive installs (as a wheel-file install is: every patch in
range is then decided by its reproduction; :func:`snapshot_behaviour.archive_overlay`). ``--pairs`` also prints the
most frequent module transitions.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

from snapshot_behaviour import private_env  # scripts/ is this script's sys.path[0]

CHILD = r"""
import json, sys
from collections import Counter

LEAVES = ("kvpatch.record", "kvpatch._warn", "kvpatch.locate", "kvpatch.store", "kvpatch.config", "kvpatch.detect",
          "kvpatch.fingerprints", "kvpatch.commits", "kvpatch.registry", "kvpatch._site", "_kvpatch_boot",
          "_kvpatch_hooks")
counts = {"all": [None, 0, Counter()], "flow": [None, 0, Counter()]}

def runtime(name):
    return name == "kvpatch" or (
        name.startswith("kvpatch.") and not name.startswith(("kvpatch.patches", "kvpatch.maint"))
    ) or name in ("_kvpatch_boot", "_kvpatch_hooks")

def profile(frame, event, arg):
    if event not in ("call", "return") or frame.f_code.co_name == "<module>":
        return
    name = frame.f_globals.get("__name__", "")
    if not runtime(name):
        return
    for kind in ("all", "flow") if not name.startswith(LEAVES) else ("all",):
        count = counts[kind]
        if count[0] is not None and name != count[0]:
            count[1] += 1
            count[2][(count[0], name)] += 1
        count[0] = name

sys.setprofile(profile)
import io, contextlib
out = io.StringIO()
with contextlib.redirect_stdout(out):
    from kvpatch.cli import main
    code = main(sys.argv[1:])
sys.setprofile(None)
data = json.loads(out.getvalue())
verified = sum(1 for row in data["patches"] if row["verdict"])
print(json.dumps({"verified": verified, "exit": code, **{
    kind: {"hops": c[1], "pairs": [[a, b, n] for (a, b), n in c[2].most_common(40)]} for kind, c in counts.items()
}}))
"""


def _run(args: list[str], env: dict[str, str], cwd: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *args], env=env, cwd=cwd, capture_output=True, text=True, check=False
    )
    try:
        result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
        return result
    except (ValueError, IndexError):
        raise SystemExit(f"count_hops: the child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}") from None


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvpatch-hops-") as tmp:
        env = private_env(tmp, "--archive" in sys.argv[1:])
        first = _run(["verify", "--json"], env, tmp)
        second = _run(["verify", "--json", "--missing"], env, tmp)
    verified = int(first["verified"])  # type: ignore[call-overload]
    print(f"verify: {verified} patch(es) verified (exit {first['exit']}); verify --missing: exit {second['exit']}")
    for kind, title in (("all", "every runtime module"), ("flow", "the flow (leaf modules looked through)")):
        total, fixed = first[kind]["hops"], second[kind]["hops"]  # type: ignore[index]
        per = (total - fixed) / verified if verified else float("nan")
        print(
            f"{title}: verify {total} hops, verify --missing {fixed}: fixed part {fixed}, per verified patch {per:.1f}"
        )
        if "--pairs" in sys.argv[1:]:
            for label, result in (("verify", first), ("verify --missing", second)):
                print(f"  most frequent transitions, {label}:")
                for a, b, n in result[kind]["pairs"]:  # type: ignore[index]
                    print(f"    {n:5}  {a} -> {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
