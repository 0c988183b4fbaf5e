"""The maintainer commands of the ``kvpatch`` console script: ``compat``, ``fingerprints``, ``upstream-check``.

:mod:`kvpatch.cli` keeps their names and one-line help (``kvpatch --help`` lists them) and imports this module
only when one of them is the command, or the topic of ``kvpatch help``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..cli import COMMANDS, EXIT_ATTENTION, EXIT_CLEAN, emit

_DESCRIPTIONS = {
    "compat": "For maintainers: render COMPAT.md, the table of patches by upstream release, from the registry.",
    "fingerprints": (
        "For maintainers: import the installed mlx-lm / mlx-vlm and print, as JSON, the source fingerprint "
        "of every target each patch replaces (what kvpatch/data/fingerprints.json records for drift checks)."
    ),
    "upstream-check": (
        "For maintainers: install the newest mlx-lm / mlx-vlm releases (or the ones named) into throwaway "
        "environments, run every patch's reproduction there without and with the patch, and compare each outcome "
        "with what the patch's record says (still affected, fixed upstream, first fixed release). Needs the package "
        "index."
    ),
}


def add_parsers(sub: Any) -> None:
    """Register the maintainer commands on the console script's subparsers."""
    from .upstream_check import add_parser

    one_liners = dict(next(commands for title, commands in COMMANDS if title == "maintainer commands"))
    compat = sub.add_parser("compat", help=one_liners["compat"], description=_DESCRIPTIONS["compat"])
    group = compat.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="write the table to --path")
    group.add_argument("--check", action="store_true", help="exit 1 when --path is not what --write would write")
    compat.add_argument("--path", default="COMPAT.md", help="the file to write or check (default: COMPAT.md)")
    compat.set_defaults(func=cmd_compat)
    fingerprints = sub.add_parser(
        "fingerprints", help=one_liners["fingerprints"], description=_DESCRIPTIONS["fingerprints"]
    )
    fingerprints.set_defaults(func=cmd_fingerprints)
    add_parser(sub)
    sub.choices["upstream-check"].description = _DESCRIPTIONS["upstream-check"]


def cmd_compat(args: argparse.Namespace) -> int:
    from .compat import render

    text = render()
    path = Path(args.path)
    if args.write:
        path.write_text(text)
        emit(f"wrote {path}")
        return EXIT_CLEAN
    if args.check:
        current = path.read_text() if path.exists() else ""
        if current != text:
            print(f"{path} is stale: run `kvpatch compat --write`", file=sys.stderr)
            return EXIT_ATTENTION
        emit(f"{path} is up to date")
        return EXIT_CLEAN
    emit(text, end="")
    return EXIT_CLEAN


def cmd_fingerprints(args: argparse.Namespace) -> int:
    from .compat import target_fingerprints

    emit(json.dumps(target_fingerprints(), indent=2))
    return EXIT_CLEAN
