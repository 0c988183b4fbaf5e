"""Regenerate every file derived from the patch units, in order, with one command (run from the clone's root):

    python -m kvpatch.maint.regenerate [--only ID,ID] [--no-fingerprints] [--no-git]    # write them
    python -m kvpatch.maint.regenerate --check [...]    # exit 1 naming each stale file; write nothing

1. ``kvpatch/data/units.json``, the unit index (:mod:`kvpatch.maint.units`);
2. ``kvpatch/data/fingerprints.json``, the targets' source fingerprints on every release of each patch's
   affected range (``scripts/record_fingerprints.py``, which layers those releases and needs the package index;
   ``--only`` measures just those patches and keeps the others' entries; ``--no-fingerprints`` leaves the file);
3. ``COMPAT.md``, the compatibility table (:mod:`kvpatch.maint.compat`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from kvpatch import registry

from . import compat, units

#: The clone's root (this module is ``kvpatch/maint/regenerate.py`` in it).
REPO = Path(__file__).resolve().parents[2]
COMPAT = REPO / "COMPAT.md"
FINGERPRINTS_SCRIPT = REPO / "scripts" / "record_fingerprints.py"


def _file(path: Path, text: str, check: bool) -> bool:
    """Write ``text`` to ``path`` (or, with ``check``, compare); True when the file was already ``text``."""
    current = path.read_text(encoding="utf-8") if path.is_file() else None
    if current == text:
        return True
    if not check:
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    return False


def fingerprints_command(only: str, *, check: bool, git: bool) -> list[str]:
    command = [sys.executable, str(FINGERPRINTS_SCRIPT)]
    if only:
        command += ["--only", only]
    if not git:
        command.append("--no-git")
    if check:
        command.append("--check")
    return command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpatch.maint.regenerate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 naming each stale file; write nothing")
    parser.add_argument("--only", default="", help="comma-separated patch ids whose fingerprints are measured")
    parser.add_argument("--no-fingerprints", action="store_true", help="leave fingerprints.json (no package index)")
    parser.add_argument("--no-git", action="store_true", help="fingerprint releases only, no git commits")
    args = parser.parse_args(argv)
    stale: list[str] = []
    index = registry.INDEX
    if not _file(index, units.render(units.expected()), args.check):
        stale.append(str(index))
    if not args.no_fingerprints:
        if not FINGERPRINTS_SCRIPT.is_file():
            print(f"{FINGERPRINTS_SCRIPT} is missing: run this from a clone of kvpatch", file=sys.stderr)
            return 2
        command = fingerprints_command(args.only, check=args.check, git=not args.no_git)
        if subprocess.run(command, cwd=REPO, check=False).returncode != 0:
            if not args.check:
                return 1  # the script said why (a release it could not measure)
            stale.append("kvpatch/data/fingerprints.json")
    if not _file(COMPAT, compat.render(), args.check):
        stale.append(str(COMPAT))
    if args.check and stale:
        print("stale: " + ", ".join(stale) + ": run python -m kvpatch.maint.regenerate", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
