"""``python -m kvpatch``: see :mod:`kvpatch.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
