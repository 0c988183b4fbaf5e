"""``python -m kvpatch``: see :mod:`kvpatch.cli`."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
