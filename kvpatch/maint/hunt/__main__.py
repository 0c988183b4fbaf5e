"""``python -m kvpatch.maint.hunt``: see :mod:`kvpatch.maint.hunt.cli`."""

import sys

from .cli import main

sys.exit(main())
