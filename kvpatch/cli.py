"""Command line: ``python -m kvpatch <command>``.

status [--json] [--check] [--verify] [--scan]   audit what is applied and why
run -m MODULE [ARGS...] | run SCRIPT [ARGS...]   run a program with kvpatch active
compat [--write | --check]              print, write or check COMPAT.md from the registry
fingerprints                            source fingerprints of every target in the installed upstream
upstream-check [--mlx-lm V|PATH] [--mlx-vlm V|PATH] [--json]   reproductions (kvpatch off) on the newest upstream
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["main"]


def _engine() -> Engine:
    import kvpatch

    return kvpatch.get_engine()


def cmd_status(args: argparse.Namespace) -> int:
    from .status import build_report, format_text

    engine = _engine()
    report = build_report(engine, verify=args.verify)
    if args.scan:
        from .vendored import format_copies, scan

        copies = scan(engine, installed=True)
        report.data["vendored"] = [c.as_dict() for c in copies]
    if args.json:
        print(json.dumps(report.data, indent=2, sort_keys=False))
    else:
        print(format_text(report))
        if args.scan:
            print(format_copies(copies))
    return report.exit_code if (args.check or args.verify) else 0


def cmd_run(argv: Sequence[str]) -> int:
    """``run -m MODULE [ARGS...]`` or ``run SCRIPT [ARGS...]``: everything after is the program's."""
    import kvpatch

    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m kvpatch run -m MODULE [ARGS...] | run SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    kvpatch.activate()
    if argv[0] == "-m" or (argv[0].startswith("-m") and len(argv[0]) > 2):
        module = argv[0][2:] or (argv[1] if len(argv) > 1 else "")
        rest = argv[2:] if argv[0] == "-m" else argv[1:]
        if not module:
            print("kvpatch run: -m needs a module name", file=sys.stderr)
            return 2
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    script, *rest = argv
    sys.argv = [script, *rest]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
    return 0


def cmd_compat(args: argparse.Namespace) -> int:
    from .compat import render

    text = render()
    path = Path(args.path)
    if args.write:
        path.write_text(text)
        print(f"wrote {path}")
        return 0
    if args.check:
        current = path.read_text() if path.exists() else ""
        if current != text:
            print(f"{path} is stale: run `python -m kvpatch compat --write`", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    print(text, end="")
    return 0


def cmd_fingerprints(args: argparse.Namespace) -> int:
    from .compat import target_fingerprints

    print(json.dumps(target_fingerprints(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvpatch", description="Audited fixes for mlx-lm / mlx-vlm KV-cache bugs."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("status", help="show what is applied and why")
    p.add_argument("--json", action="store_true", help="machine-readable output (schema kvpatch.status/1)")
    p.add_argument("--check", action="store_true", help="exit 0 clean, 1 action needed, 2 a patch failed")
    p.add_argument(
        "--verify", action="store_true", help="run each relevant reproduction with and without its patch (imports mlx)"
    )
    p.add_argument(
        "--scan",
        action="store_true",
        help="also list vendored copies of patched upstream code in installed servers (reads files only)",
    )
    p.set_defaults(func=cmd_status)

    sub.add_parser("run", help="run -m MODULE [ARGS...] or SCRIPT [ARGS...] with kvpatch active")

    p = sub.add_parser("compat", help="render COMPAT.md from the registry")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true")
    group.add_argument("--check", action="store_true")
    p.add_argument("--path", default="COMPAT.md")
    p.set_defaults(func=cmd_compat)

    p = sub.add_parser("fingerprints", help="print source fingerprints of every target (imports upstream)")
    p.set_defaults(func=cmd_fingerprints)

    from .upstream_check import add_parser as add_upstream_check

    add_upstream_check(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        return cmd_run(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
