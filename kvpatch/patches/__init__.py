"""kvpatch's patch units: one module per upstream bug (installed as ``kvpatch.patches``).

Each module defines ``PATCH`` (a :class:`kvpatch.record.Patch`) with its builders and its
reproduction. See CONTRIBUTING.md, "Adding a patch".
"""
