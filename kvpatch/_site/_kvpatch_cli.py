"""The ``kvpatch`` console script, a top-level module beside ``kvpatch``: a kvpatch that cannot be imported (a broken
install) exits 70, kvpatch's internal error, never Python's 1 (``status --check``'s "attention needed")."""

import sys
import traceback

EXIT_INTERNAL = 70  # = kvpatch.cli.EXIT_INTERNAL (a test keeps them equal)
starting = False  # kvpatch, imported for the command line, activates after it has parsed its arguments


def main():
    global starting
    starting = True
    try:
        from kvpatch.cli import main as cli_main
    except KeyboardInterrupt:
        return 130  # = kvpatch.cli.EXIT_INTERRUPTED
    except Exception as exc:
        traceback.print_exc()
        print(
            f"kvpatch: internal error (exit {EXIT_INTERNAL}): kvpatch cannot be imported "
            f"({type(exc).__name__}: {exc}); reinstall it",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
    return cli_main()
