"""Patches kvpatch no longer carries, for COMPAT.md's "Retired patches" section.

A patch is retired when every supported upstream release has upstream's fix (see
:mod:`kvpatch.maint.expiry`): its module is deleted from ``kvpatch/patches/`` and one :class:`Retired` entry is
added here, so that users pinned to an old upstream release can find the last kvpatch release that
still carries it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RETIRED", "Retired", "render_retired"]


@dataclass(frozen=True)
class Retired:
    id: str
    catalogue: str
    distribution: str
    #: First upstream release with upstream's fix.
    fixed_in: str
    #: The last kvpatch release whose registry carries the patch.
    last_release: str
    note: str = ""


#: Retired patches, oldest retirement first.
RETIRED: tuple[Retired, ...] = ()


def render_retired(retired: tuple[Retired, ...] = RETIRED) -> str:
    """The markdown section (ends with a newline)."""
    out = [
        "## Retired patches",
        "",
        "Patches removed from kvpatch because every upstream release it supports carries upstream's fix.",
        "If you are pinned to an older upstream release, pin kvpatch to the last release that carries the patch.",
        "",
    ]
    if not retired:
        out.append("None yet: every patch kvpatch has shipped is still in the registry.")
    else:
        out += [
            "| patch | catalogue | distribution | fixed upstream in | last kvpatch release with it | note |",
            "|---|---|---|---|---|---|",
        ]
        out += [
            f"| `{r.id}` | {r.catalogue} | {r.distribution} | {r.fixed_in} | {r.last_release} | {r.note} |"
            for r in retired
        ]
    return "\n".join(out) + "\n"
