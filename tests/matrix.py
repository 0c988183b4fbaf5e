"""The upstream release matrix, for the tests and scripts: defined once in :mod:`kvpatch.maint.matrix`."""

from __future__ import annotations

from kvpatch.maint.matrix import (
    BASE_REQUIREMENTS,
    BUCKETS,
    BY_NAME,
    COEXIST_BUCKETS,
    COEXIST_BY_NAME,
    LM_BUCKETS,
    SUPPORTED_FLOOR,
    TESTED,
    VLM_BUCKETS,
)

__all__ = [
    "BASE_REQUIREMENTS",
    "BUCKETS",
    "BY_NAME",
    "COEXIST_BUCKETS",
    "COEXIST_BY_NAME",
    "LM_BUCKETS",
    "SUPPORTED_FLOOR",
    "TESTED",
    "VLM_BUCKETS",
]
