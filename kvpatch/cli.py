"""Command line: the ``kvpatch`` console script (also ``python -m kvpatch``).

status [-v] [--json] [--check] [--verify] [--scan] audit what is applied and why
verify [--json] [--missing]             measure and cache the verdicts this environment's imports read
run -m MODULE [ARGS...] | run SCRIPT [ARGS...]   run a program with kvpatch active
compat [--write | --check]              print, write or check COMPAT.md from the registry (maintainers)
fingerprints                            source fingerprints of every target in the installed upstream (maintainers)
upstream-check [--mlx-lm V|PATH] [--mlx-vlm V|PATH] [--json]   reproductions (kvpatch off) on the newest upstream

Exit status (one table, :data:`EXIT_CODES`, printed by ``kvpatch status --help``): 0 clean, 1 attention
needed, 2 a patch failed or did not fix its bug, 64 usage error, 70 kvpatch's own internal error, 130
interrupted. ``run`` exits with the program's own status. A closed pipe (``kvpatch status --json | head -1``)
changes nothing: no traceback, the same exit status.

The maintainer commands (compat, fingerprints, upstream-check) import :mod:`kvpatch.maint` only when
they run; ``status`` never does.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from .engine import Engine

__all__ = [
    "EXIT_ATTENTION",
    "EXIT_CLEAN",
    "EXIT_CODES",
    "EXIT_FAILED",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "build_parser",
    "main",
]

EXIT_CLEAN = 0
EXIT_ATTENTION = 1
EXIT_FAILED = 2
EXIT_USAGE = 64  # sysexits.h EX_USAGE
EXIT_INTERNAL = 70  # sysexits.h EX_SOFTWARE
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it

#: The exit-code table (``status --help``, README): code, meaning.
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_CLEAN, "clean: nothing needs attention"),
    (EXIT_ATTENTION, "attention needed (with --check or --verify): the reasons are listed under 'check'"),
    (EXIT_FAILED, "a patch failed, did not fix its bug, or a patch unit could not be loaded (--check, --verify)"),
    (EXIT_USAGE, "usage error: unknown command or option"),
    (EXIT_INTERNAL, "kvpatch's own internal error (a bug in kvpatch: please report the traceback)"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C)"),
)

_STATUS_EPILOG = (
    "exit status:\n"
    + "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES)
    + "\n\nWithout --check or --verify, status exits 0 whatever it reports (1 and 2 are for scripts that ask).\n"
    "A closed pipe (kvpatch status --json | head -1) changes nothing: no traceback, the same exit status.\n"
    "The JSON output follows kvpatch/data/status.schema.json (schema id kvpatch.status/1)."
)


class _Parser(argparse.ArgumentParser):
    """Usage errors exit 64, not argparse's 2 (which ``status --check`` uses for a failed patch)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _engine() -> Engine:
    import kvpatch

    return kvpatch.get_engine()


def _emit(text: str, *, end: str = "\n") -> None:
    """Write to stdout; a reader that went away (``| head -1``) ends the output quietly."""
    try:
        sys.stdout.write(text + end)
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()


def _silence_stdout() -> None:
    # Python flushes stdout again at exit: point it at /dev/null so that flush cannot fail either.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real file descriptor behind stdout
        pass


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from .status import build_report, format_text

    engine = _engine()
    report = build_report(engine, verify=args.verify, settle=not args.no_settle, fresh=args.fresh)
    copies = None
    if args.scan:
        from .vendored import format_copies, scan

        copies = scan(engine, installed=True)
        report.data["vendored"] = [c.as_dict() for c in copies]
    code = report.exit_code if (args.check or args.verify) else EXIT_CLEAN
    if args.json:
        _emit(json.dumps(report.data, indent=2, sort_keys=False))
    else:
        _emit(format_text(report, verbose=args.verbose, width=_terminal_width()))
        if copies is not None:
            _emit(format_copies(copies))
    return code


def _terminal_width() -> int | None:
    """The terminal's width when stdout is one; ``None`` (never cut a line) for pipes and files."""
    try:
        if not sys.stdout.isatty():
            return None
    except (AttributeError, ValueError):
        return None
    import shutil

    return shutil.get_terminal_size().columns


def cmd_run(argv: Sequence[str]) -> int:
    """``run -m MODULE [ARGS...]`` or ``run SCRIPT [ARGS...]``: everything after is the program's."""
    import runpy

    import kvpatch

    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvpatch run -m MODULE [ARGS...] | kvpatch run SCRIPT [ARGS...]", file=sys.stderr)
        return EXIT_CLEAN if argv else EXIT_USAGE
    kvpatch.activate()
    if argv[0] == "-m" or (argv[0].startswith("-m") and len(argv[0]) > 2):
        module = argv[0][2:] or (argv[1] if len(argv) > 1 else "")
        rest = argv[2:] if argv[0] == "-m" else argv[1:]
        if not module:
            print("kvpatch run: -m needs a module name", file=sys.stderr)
            return EXIT_USAGE
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    script, *rest = argv
    sys.argv = [script, *rest]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
    return 0


def cmd_compat(args: argparse.Namespace) -> int:
    from .maint.compat import render

    text = render()
    path = Path(args.path)
    if args.write:
        path.write_text(text)
        _emit(f"wrote {path}")
        return 0
    if args.check:
        current = path.read_text() if path.exists() else ""
        if current != text:
            print(f"{path} is stale: run `kvpatch compat --write`", file=sys.stderr)
            return EXIT_ATTENTION
        _emit(f"{path} is up to date")
        return 0
    _emit(text, end="")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .verify import run

    return run(args)


def cmd_fingerprints(args: argparse.Namespace) -> int:
    import json

    from .maint.compat import target_fingerprints

    _emit(json.dumps(target_fingerprints(), indent=2))
    return 0


def _add_upstream_check(sub: Any, *, full: bool) -> None:
    if full:
        from .maint.upstream_check import add_parser

        add_parser(sub)
    else:  # listed in the help; its options load with the command itself
        sub.add_parser(
            "upstream-check",
            help="run every reproduction (kvpatch off) on the newest upstream releases and compare with the records",
        )


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; maintainer commands' options are only loaded when ``command`` is one of them (or None)."""
    parser = _Parser(prog="kvpatch", description="Audited fixes for mlx-lm / mlx-vlm KV-cache bugs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "status",
        help="show what is applied and why",
        description="Show which kvpatch patches apply to the installed mlx / mlx-lm / mlx-vlm, and why.",
        epilog=_STATUS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="store_true", help="every patch, with its targets and the full reason")
    p.add_argument("--json", action="store_true", help="machine-readable output (schema kvpatch.status/1)")
    p.add_argument("--check", action="store_true", help="exit 0 clean, 1 attention needed, 2 a patch failed")
    p.add_argument(
        "--verify", action="store_true", help="run each relevant reproduction with and without its patch (imports mlx)"
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="settle outcomes again (import upstream) even if the environment is unchanged",
    )
    p.add_argument(
        "--no-settle", action="store_true", help="predictions only: read package metadata, import nothing of upstream"
    )
    p.add_argument(
        "--scan",
        action="store_true",
        help="also list vendored copies of patched upstream code in installed servers (reads files only)",
    )
    p.set_defaults(func=cmd_status)

    sub.add_parser("run", help="run -m MODULE [ARGS...] or SCRIPT [ARGS...] with kvpatch active")

    from .verify import add_arguments as add_verify_arguments

    p = sub.add_parser("verify", help="run the reproductions the facts leave open and cache their verdicts")
    add_verify_arguments(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("compat", help="render COMPAT.md from the registry (maintainers)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true")
    group.add_argument("--check", action="store_true")
    p.add_argument("--path", default="COMPAT.md")
    p.set_defaults(func=cmd_compat)

    p = sub.add_parser("fingerprints", help="print source fingerprints of every target (imports upstream; maintainers)")
    p.set_defaults(func=cmd_fingerprints)

    _add_upstream_check(sub, full=command in (None, "upstream-check"))
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (its first word that is not an option), if any."""
    for word in argv:
        if not word.startswith("-"):
            return word
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see :data:`EXIT_CODES`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        return cmd_run(argv[1:])  # the program's own errors are its own: Python reports them
    try:
        try:
            args = build_parser(_command(argv)).parse_args(argv)
        except SystemExit as exc:  # --help (0) or a usage error (64)
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_CLEAN
    except Exception:
        _internal_error()
        return EXIT_INTERNAL


def _internal_error() -> None:
    try:
        import traceback

        traceback.print_exc()
        print(
            f"kvpatch: internal error (exit {EXIT_INTERNAL}): a bug in kvpatch, not a finding about your environment; "
            "please report it with the traceback above",
            file=sys.stderr,
        )
    except Exception:  # pragma: no cover - stderr gone too
        pass
