"""Maintainer tooling: never imported by the runtime.

``import kvpatch``, the ``.pth`` bootstrap and ``kvpatch status`` (without ``--verify``) load nothing
from here (``tests/engine/test_cli.py`` checks it). The CLI imports these modules lazily, for the
maintainer commands only:

- :mod:`.matrix`: the release matrix (the buckets of real releases the tests run, the releases
  COMPAT.md lists, and the supported floor that expiry reads). The one source of all three.
- :mod:`.envs`: cached release layers (``pip install --target``) and bucket environments.
- :mod:`.compat`: COMPAT.md and target fingerprints (``kvpatch compat``, ``kvpatch fingerprints``).
- :mod:`.expiry` and :mod:`.retired`: when a patch must go, and the list of those gone.
- :mod:`.upstream_check`: reproductions on the newest upstream (``kvpatch upstream-check``).
- :mod:`.sources`: upstream source read from a layer without importing it.
- :mod:`.new` and :mod:`.regenerate`: a new patch unit (``python -m kvpatch.maint.new``) and the one command that
  rewrites the files derived from the units (``python -m kvpatch.maint.regenerate``).
"""
