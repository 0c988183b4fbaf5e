"""The ``kvpatch`` console script (also ``python -m kvpatch``): argparse plumbing around the commands, whose exit
statuses are one table, :data:`EXIT_CODES`."""

from __future__ import annotations

import argparse
import builtins
import contextlib
import difflib
import importlib.util
import json
import os
import runpy
import shutil
import sys
import traceback
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from . import __version__, activate, get_engine
from ._site import BrokenInstall
from .registry import load
from .status import build_report, cut, format_text
from .vendored import format_copies, scan
from .verifier import Verifier

#: The exit-code table (``status --help``, ``kvpatch --help``, the docs): code, meaning.
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (0, "clean: nothing needs attention"),
    (1, "attention needed (with --check or --verify): the reasons are listed under 'check'"),
    (2, "a patch failed, did not fix its bug, or a patch unit could not be loaded (--check, --verify)"),
    (64, "usage error: unknown command or option, or a program for `run` that does not exist"),  # EX_USAGE
    (70, "kvpatch's own internal error (a bug in kvpatch: please report the traceback)"),  # EX_SOFTWARE
    (74, "the output could not be written (standard output closed, disk full)"),  # EX_IOERR
    (130, "interrupted (Ctrl-C)"),  # 128 + SIGINT, as shells report it
)
EXIT_CLEAN, EXIT_ATTENTION, EXIT_FAILED, EXIT_USAGE, EXIT_INTERNAL, EXIT_IOERR, EXIT_INTERRUPTED = dict(EXIT_CODES)

_USER_COMMANDS = {
    "status": "show which patches apply here and why (--check for scripts, --verify to measure)",
    "verify": "run the reproductions whose outcome depends on this environment and store the verdicts",
    "run": "run a program (-c CODE, -m MODULE or SCRIPT) with kvpatch active, like python",
    "list": "list every patch: id, upstream package, affected releases, the bug it fixes",
    "version": "print kvpatch's version (also -V, --version)",
    "help": "show this help, or a command's (kvpatch help status)",
}
_MAINTAINER_COMMANDS = {
    "compat": "print, write or check COMPAT.md (the compatibility table) from the registry",
    "fingerprints": "print the source fingerprint of every patch target in the installed upstream",
    "upstream-check": "run every reproduction (kvpatch off) on the newest upstream releases",
}
_HELP = _USER_COMMANDS | _MAINTAINER_COMMANDS
#: The commands as the help lists them: (section, ((name, one-line help), ...)).
COMMANDS = (("commands", tuple(_USER_COMMANDS.items())), ("maintainer commands", tuple(_MAINTAINER_COMMANDS.items())))

_RUN_USAGE = "kvpatch run [-h] (-c CODE | -m MODULE | SCRIPT) [ARGS ...]"

#: Each user command's ``--help``: its paragraph and epilog.
_HELP_TEXT = {
    "status": (
        "Show which kvpatch patches apply to the installed mlx / mlx-lm / mlx-vlm, and\n"
        "why. It reads package metadata and, once per environment, imports the upstream\n"
        "modules to settle what an import would do.",
        "exit status:\n"
        + "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES)
        + "\n\nWithout --check or --verify, status exits 0 whatever it reports (1 and 2 are for scripts that ask).\n"
        "A closed pipe (kvpatch status --json | head -1) changes nothing: no traceback, the same exit status.\n"
        "The JSON output follows kvpatch/data/status.schema.json (schema id kvpatch.status/1).",
    ),
    "verify": (
        "Settle, in this process, every verdict this environment's imports will read: for each patch whose "
        "outcome the installed release does not decide by itself (a release newer than the patch was checked "
        "on, an editable, directory or git install, drifted target code), run its reproduction without and "
        "with the patch and store the verdict, so later imports measure nothing. Run it after installing or "
        "upgrading (a Dockerfile's last step, CI, a deployment hook). To audit every relevant patch, "
        "whatever decides it, run `kvpatch status --verify`.",
        "exit status: 0 every patch settled, 1 a verdict is inconclusive, a patch drifted or failed.",
    ),
    "run": (
        "Run a Python program with kvpatch active from its first line, the way `python` runs it:\n"
        "-c CODE runs a string, -m MODULE runs a module as __main__, SCRIPT runs a file (or a directory\n"
        "or zip with __main__.py). Everything after the program is its own arguments (sys.argv[1:]).\n"
        "kvpatch activates before the program starts, also where the start-up hook does not run\n"
        "(python -S, a source tree on PYTHONPATH).",
        "exit status: the program's own; 64 when there is no program to run (no such file, no -c code,\n"
        "no -m module name).\n"
        "examples:\n"
        "  kvpatch run -c 'import mlx_lm, kvpatch; print(kvpatch.records())'\n"
        "  kvpatch run -m mlx_lm.server --model ...\n"
        "  kvpatch run serve.py --port 8080",
    ),
    "list": ("List every patch kvpatch ships, one line each.", None),
    "version": ("Print kvpatch's version, where it is, and Python's.", None),
    "help": ("Show kvpatch's help (its commands and what they do), or one command's: kvpatch help status.", None),
}


class _Parser(argparse.ArgumentParser):
    """Usage errors exit 64, not argparse's 2 (which ``status --check`` uses for a failed patch)."""

    def error(self, message: str) -> NoReturn:
        unknown = message.removeprefix("unrecognized arguments: ").split() if "unrecognized" in message else []
        options = [o for o in self._option_string_actions if o.startswith("--")]
        close = [c for w in unknown if w.startswith("-") for c in difflib.get_close_matches(w, options, n=1)]
        hint = f" - did you mean {close[0]!r}?" if close else ""
        with contextlib.suppress(Exception):
            print(f"{self.format_usage()}{self.prog}: error: {message}{hint}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extra = super().parse_known_args(args, namespace)
        if extra and self.prog != "kvpatch":  # a command's unknown option is reported with that command's usage
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed, extra

    def print_help(self, file: Any = None) -> None:
        emit(self.format_help(), end="")  # argparse ignores a failed write: --help > /dev/full would exit 0


def emit(text: str, *, end: str = "\n") -> None:
    """Print ``text`` and flush it, for a command (also the maintainer commands'): a reader that went away ends
    the output quietly; any other failure to write ends the command with :data:`EXIT_IOERR` and one line."""
    try:
        if sys.stdout is None:
            raise OSError(0, "standard output is closed")
        sys.stdout.write(text + end)
        sys.stdout.flush()
    except (OSError, ValueError) as exc:  # ValueError: the stream object itself was closed
        # stdout to /dev/null: Python flushes it again at exit, and that flush must not fail either
        with contextlib.suppress(OSError, ValueError, AttributeError):  # no real file descriptor behind stdout
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        if isinstance(exc, BrokenPipeError):
            return
        with contextlib.suppress(Exception):  # stderr gone too: the exit status says it
            why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            print(f"kvpatch: cannot write the output: {why} (exit {EXIT_IOERR})", file=sys.stderr)
        raise SystemExit(EXIT_IOERR) from None


def cmd_status(args: argparse.Namespace) -> int:
    if args.verify:
        Verifier.begin()  # before anything imports upstream
    activate()
    engine = get_engine()
    report = build_report(engine, verify=args.verify, settle=not args.no_settle, fresh=args.fresh)
    copies = scan(engine, installed=True) if args.scan else None
    if copies is not None:
        report.data["vendored"] = [c.as_dict() for c in copies]
    asked = args.check or args.verify
    if args.json:
        emit(json.dumps(report.data, indent=2))
    else:
        emit(format_text(report, verbose=args.verbose, width=_width(tty_only=not args.verbose), check=asked))
        if copies is not None:
            emit(format_copies(copies))
    return int(report.data["check"]["exit"]) if asked else EXIT_CLEAN


def _width(*, tty_only: bool) -> int | None:
    """The terminal's width, ``$COLUMNS`` or 80; ``None`` (never cut a line) for a pipe or file when ``tty_only``."""
    with contextlib.suppress(AttributeError, ValueError):
        if not tty_only or sys.stdout.isatty():
            return shutil.get_terminal_size().columns
    return None


def cmd_version(args: argparse.Namespace) -> int:
    where = os.path.dirname(os.path.abspath(__file__))
    emit(f"kvpatch {__version__} from {where} (Python {'.'.join(map(str, sys.version_info[:3]))})")
    return EXIT_CLEAN


def cmd_list(args: argparse.Namespace) -> int:
    reg = load()
    patches = sorted(reg.patches, key=lambda p: (p.distribution, p.id))
    if args.json:
        rows = [{k: getattr(p, k) for k in ("id", "distribution", "affected", "opt_in", "summary")} for p in patches]
        emit(json.dumps({"patches": rows, "broken": dict(reg.broken)}, indent=2))
    else:
        width, pad = _width(tty_only=True), max((len(p.id) for p in patches), default=0)
        for p in patches:
            summary = ("opt-in: " if p.opt_in else "") + p.summary
            emit(cut(f"{p.id:<{pad}}  {p.distribution:<7}  {p.affected:<18}  {summary}", width))
        emit(f"{len(patches)} patches; `kvpatch status` says which apply here")
    for module, error in reg.broken.items():
        print(f"kvpatch: patch module {module} cannot be loaded: {error}", file=sys.stderr)
    return EXIT_FAILED if reg.broken else EXIT_CLEAN


def cmd_run(argv: Sequence[str]) -> int:
    """``run -c CODE | -m MODULE | SCRIPT [ARGS...]``: everything after the program is the program's, as with python."""
    usage_error = _Parser(prog="kvpatch run", usage=_RUN_USAGE).error  # exits 64
    if not argv:
        usage_error("say what to run: -c CODE, -m MODULE or SCRIPT")
    kind = argv[0][:2] if argv[0][:2] in ("-c", "-m") else None
    if kind:  # -cCODE or -c CODE
        argv = [argv[0][2:], *argv[1:]] if argv[0][2:] else argv[1:]
        if not (argv and argv[0]):
            usage_error(f"{kind} needs " + ("the code to run" if kind == "-c" else "a module name"))
    elif argv[0].startswith("-"):
        usage_error(f"unknown option {argv[0]!r} (the program comes first: -c CODE, -m MODULE or SCRIPT)")
    elif not os.path.exists(argv[0]):
        usage_error(f"can't open file {argv[0]!r}: no such file or directory")
    value, rest = argv[0], argv[1:]
    activate()
    sys.argv = ["-c" if kind == "-c" else value, *rest]
    if kind == "-c":  # as `python -c`: a fresh __main__, with the working directory first on sys.path
        sys.modules["__main__"] = main_module = types.ModuleType("__main__")
        main_module.__dict__["__builtins__"] = builtins
        sys.path.insert(0, "")
        exec(compile(value, "<string>", "exec"), main_module.__dict__)
    elif kind == "-m":
        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(value) is not None
        except ModuleNotFoundError as exc:  # a parent package that does not exist (else: the program's own error)
            if not f"{value}.".startswith(f"{exc.name}."):
                raise
            found = False
        except ValueError:  # a relative or empty name
            found = False
        if not found:
            usage_error(f"no module named {value!r}")
        runpy.run_module(value, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, str(Path(value).resolve().parent))
        runpy.run_path(value, run_name="__main__")
    return EXIT_CLEAN


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; the maintainer commands' parsers (:mod:`kvpatch.maint.cli`) load only when ``command`` is
    one of them or None (``""``: a command line that names no command, as ``kvpatch --help``)."""
    parser = _Parser(
        prog="kvpatch",
        usage="kvpatch [-h] [--version] COMMAND [ARGS ...]",
        description=(
            "Version-gated, audited fixes for known KV-cache bugs in mlx-lm and mlx-vlm. Installed, kvpatch "
            "activates itself in every Python process of this environment on the first mlx_lm / mlx_vlm "
            "import; KVPATCH=off turns it off."
        ),
        epilog=(
            "`kvpatch help COMMAND` or `kvpatch COMMAND --help` describes a command; "
            "`kvpatch status --help` lists the exit statuses."
        ),
    )
    parser.add_argument("-V", "--version", action="store_true", help="print kvpatch's version and exit")
    for title, listed in COMMANDS:  # for the help only: the subparsers below parse the commands
        group = parser.add_argument_group(title)
        group._group_actions += [argparse.Action([], dest=name, metavar=name, help=text) for name, text in listed]
    parser._action_groups.append(parser._action_groups.pop(1))  # "options" after the commands
    sub = parser.add_subparsers(dest="command", help=argparse.SUPPRESS, parser_class=_Parser, prog="kvpatch")
    p = {}
    for name, (description, epilog) in _HELP_TEXT.items():  # a text with line breaks keeps them
        fmt = argparse.RawDescriptionHelpFormatter if "\n" in description else argparse.HelpFormatter
        p[name] = sub.add_parser(name, description=description, epilog=epilog, formatter_class=fmt)
    p["run"].usage = _RUN_USAGE
    for flags, text in (
        (("-v", "--verbose"), "every patch, with its targets and the full reason"),
        (("--json",), "machine-readable output (schema kvpatch.status/1)"),
        (("--check",), "exit 0 clean, 1 attention needed, 2 a patch failed"),
        (("--verify",), "run each relevant reproduction with and without its patch (imports mlx)"),
        (("--fresh",), "settle outcomes again (import upstream) even if the environment is unchanged"),
        (("--no-settle",), "predictions only: read package metadata, import nothing of upstream"),
        (("--scan",), "also list vendored copies of patched upstream code in installed servers (reads files only)"),
    ):
        p["status"].add_argument(*flags, action="store_true", help=text)
    from . import verify

    verify.add_arguments(p["verify"])
    p["list"].add_argument("--json", action="store_true", help="machine-readable output")
    p["help"].add_argument("topic", nargs="?", metavar="COMMAND", help="the command to describe")
    p["help"].set_defaults(func=lambda args: main([*filter(None, [args.topic]), "--help"]))
    for name, func in {"status": cmd_status, "verify": verify.run, "list": cmd_list, "version": cmd_version}.items():
        p[name].set_defaults(func=func)
    if command is None or command in _MAINTAINER_COMMANDS:  # the runtime's one import of kvpatch.maint (a test checks)
        from .maint.cli import add_parsers

        add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see :data:`EXIT_CODES`)."""
    argv = list(sys.argv[1:] if argv is None else argv) or ["--help"]  # bare `kvpatch`: the help, as pip does
    if argv[:1] == ["run"] and argv[1:2] not in (["-h"], ["--help"]):
        return cmd_run(argv[1:])  # the program's own errors are its own: Python reports them
    try:
        command = next((word for word in argv if not word.startswith("-")), "")  # the first word not an option
        parser = build_parser(command)
        if command and command not in _HELP:
            close = difflib.get_close_matches(command, list(_HELP), n=1, cutoff=0.6)
            hint = f" - did you mean {close[0]!r}?" if close else " (`kvpatch help` lists the commands)"
            parser.error(f"unknown command {command!r}{hint}")
        args = parser.parse_args(argv)
        code = int((cmd_version if args.version else args.func)(args) or 0)
        if sys.stdout is not None:
            emit("", end="")  # what print left buffered: a failure is reported here, not at interpreter exit
        return code
    except SystemExit as exc:  # --help (0), a usage error (64), output that could not be written (74)
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        with contextlib.suppress(Exception):  # sys.exit("message"): the message, as Python prints it
            print(exc.code, file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenInstall as exc:  # not a bug to report: a file of the install is missing
        with contextlib.suppress(Exception):
            print(f"kvpatch: {exc} (exit {EXIT_INTERNAL})", file=sys.stderr)
        return EXIT_INTERNAL
    except Exception as exc:
        if isinstance(exc, OSError) and sys.stdout is not None:  # a command's own print: is stdout what failed?
            try:
                emit("", end="")  # a reader that went away: stdout now points at /dev/null
            except SystemExit:
                return EXIT_IOERR
            if isinstance(exc, BrokenPipeError):
                return EXIT_CLEAN
        with contextlib.suppress(Exception):
            traceback.print_exc()
            print(
                f"kvpatch: internal error (exit {EXIT_INTERNAL}): a bug in kvpatch, not a finding about your "
                "environment; please report it with the traceback above",
                file=sys.stderr,
            )
        return EXIT_INTERNAL
