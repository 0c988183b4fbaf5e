"""Command line: ``python -m kvpatch <command>``.

status [--json] [--check] [--verify]   audit what is applied and why
run -m MODULE [ARGS...] | run SCRIPT [ARGS...]   run a program with kvpatch active
compat [--write | --check]              print, write or check COMPAT.md from the registry
fingerprints                            source fingerprints of every target in the installed upstream
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def _engine():  # type: ignore[no-untyped-def]
    import kvpatch

    return kvpatch.get_engine()


def cmd_status(args: argparse.Namespace) -> int:
    from .status import build_report, format_text

    engine = _engine()
    report = build_report(engine, verify=args.verify)
    if args.json:
        print(json.dumps(report.data, indent=2, sort_keys=False))
    else:
        print(format_text(report))
    return report.exit_code if (args.check or args.verify) else 0


def cmd_run(args: argparse.Namespace) -> int:
    import kvpatch

    kvpatch.activate()
    if args.module:
        sys.argv = [args.module, *args.args]
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    else:
        if not args.args:
            print("kvpatch run: give -m MODULE or a script path", file=sys.stderr)
            return 2
        script, *rest = args.args
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
    parser = argparse.ArgumentParser(prog="python -m kvpatch", description="Audited fixes for mlx-lm / mlx-vlm KV-cache bugs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("status", help="show what is applied and why")
    p.add_argument("--json", action="store_true", help="machine-readable output (schema kvpatch.status/1)")
    p.add_argument("--check", action="store_true", help="exit 0 clean, 1 action needed, 2 a patch failed")
    p.add_argument("--verify", action="store_true", help="run each relevant reproduction with and without its patch (imports mlx)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("run", help="run a module or script with kvpatch active")
    p.add_argument("-m", dest="module", help="module to run as __main__")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("compat", help="render COMPAT.md from the registry")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true")
    group.add_argument("--check", action="store_true")
    p.add_argument("--path", default="COMPAT.md")
    p.set_defaults(func=cmd_compat)

    p = sub.add_parser("fingerprints", help="print source fingerprints of every target (imports upstream)")
    p.set_defaults(func=cmd_fingerprints)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
