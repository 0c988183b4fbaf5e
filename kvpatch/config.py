"""Every environment variable kvpatch reads, in one place (``docs/configuration.md`` is their table).

The bootstrap in ``kvpatch/_site`` cannot import kvpatch and reads ``KVPATCH`` itself; :func:`is_off` asks it.
A malformed value never raises: it is reported through :attr:`Config.problems` and warned about once, quoting
at most :data:`SHOWN` characters, and an unknown patch id gets its closest known id as a suggestion.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ._site import boot as _boot

__all__ = [
    "OFF_VALUES",
    "ON_VALUES",
    "SHOWN",
    "VARIABLES",
    "Config",
    "background_verification",
    "cache_override",
    "is_off",
    "read_config",
    "values",
    "vendored",
    "verdicts_override",
    "verifying",
]

#: The most characters of one environment value a message quotes.
SHOWN = 60
#: The most unknown ids one message names.
_NAMED = 3

OFF_VALUES = frozenset(_boot().OFF_VALUES)  # the bootstrap's: it reads KVPATCH before kvpatch can be imported
ON_VALUES = frozenset({"", "on", "1", "true", "yes", "enable", "enabled", "auto"})

#: ``off`` (:data:`OFF_VALUES`): kvpatch does nothing, auto-activation included.
OFF = "KVPATCH"
#: Comma-separated patch ids to leave out; ``*``: all.
DISABLE = "KVPATCH_DISABLE"
#: Comma-separated ids of opt-in patches (they change documented upstream behaviour) to turn on; ``*``: all.
ENABLE = "KVPATCH_ENABLE"
#: ``1``: overdue patches fail ``status --check`` and the test suite.
ENFORCE = "KVPATCH_ENFORCE"
#: ``never``: no background verification.
VERIFY = "KVPATCH_VERIFY"
#: The one directory verdicts are read from and written to (:mod:`kvpatch.store`).
VERDICTS = "KVPATCH_VERDICTS"
#: The root of kvpatch's per-user state (:mod:`kvpatch.store`).
CACHE = "KVPATCH_CACHE"
#: ``1``: patch vendored copies of upstream code too; module names: hook those as well (:mod:`kvpatch.vendored`).
VENDORED = "KVPATCH_VENDORED"
#: Set by kvpatch in the environment of a verification process (the background child, ``kvpatch verify``).
VERIFYING = "KVPATCH_VERIFYING"
#: Every variable a user sets (what an import does depends on each: ``kvpatch.settle`` keys on all of them).
VARIABLES = (OFF, DISABLE, ENABLE, ENFORCE, VERIFY, VERDICTS, CACHE, VENDORED)
_VERIFY_OFF = frozenset({"never", "off", "0", "no", "false"})


@dataclass(frozen=True)
class Config:
    enabled: bool = True
    disabled_ids: frozenset[str] = frozenset()
    disable_all: bool = False
    enforce: bool = False
    problems: tuple[str, ...] = ()
    enabled_ids: frozenset[str] = frozenset()
    enable_all: bool = False

    def is_disabled(self, patch_id: str) -> bool:
        return self.disable_all or patch_id in self.disabled_ids

    def is_opted_in(self, patch_id: str) -> bool:
        return self.enable_all or patch_id in self.enabled_ids


def read_config(environ: Mapping[str, str] | None = None, known_ids: frozenset[str] | None = None) -> Config:
    env = _env(environ)
    problems: list[str] = []

    raw = env.get(OFF, "").strip().lower()
    if is_off(env):
        enabled = False
    else:
        enabled = True
        if raw not in ON_VALUES:
            value = _shown(env.get(OFF, ""))
            problems.append(f"KVPATCH={value} is not understood (use 'off' or 'on'); kvpatch stays on")

    disabled, disable_all = _ids(env, DISABLE, known_ids, problems)
    opted, enable_all = _ids(env, ENABLE, known_ids, problems)

    enforce_raw = env.get(ENFORCE, "").strip().lower()
    enforce = False
    if enforce_raw and enforce_raw not in OFF_VALUES:
        if enforce_raw in ON_VALUES:
            enforce = True
        else:
            value = _shown(env.get(ENFORCE, ""))
            problems.append(f"KVPATCH_ENFORCE={value} is not understood (use 1 or 0); not enforcing")

    return Config(enabled, frozenset(disabled), disable_all, enforce, tuple(problems), frozenset(opted), enable_all)


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def is_off(environ: Mapping[str, str] | None = None) -> bool:
    """``KVPATCH=off``: kvpatch does nothing in this process (the bootstrap's one reading of it)."""
    return bool(_boot().is_off(_env(environ)))


def background_verification() -> bool:
    """Whether a process without a verdict may start a background verification (:data:`VERIFY`)."""
    return os.environ.get(VERIFY, "").strip().lower() not in _VERIFY_OFF


def verifying() -> bool:
    """Whether this process was started as a verification process (:data:`VERIFYING`)."""
    return bool(os.environ.get(VERIFYING))


def verdicts_override() -> str | None:
    return os.environ.get(VERDICTS) or None


def cache_override() -> str | None:
    return os.environ.get(CACHE) or None


def vendored(environ: Mapping[str, str] | None = None) -> str:
    """:data:`VENDORED` as set, stripped (``""``: unset); :func:`kvpatch.vendored.setting` parses it."""
    return _env(environ).get(VENDORED, "").strip()


def values() -> list[tuple[str, str | None]]:
    """Each of :data:`VARIABLES` with its value (``None``: unset)."""
    return [(name, os.environ.get(name)) for name in VARIABLES]


def _ids(
    env: Mapping[str, str], variable: str, known_ids: frozenset[str] | None, problems: list[str]
) -> tuple[set[str], bool]:
    """The ids a comma-separated variable names, and whether it says ``*``."""
    ids: set[str] = set()
    unknown: list[str] = []
    every = False
    for item in env.get(variable, "").split(","):
        item = item.strip().lower()
        if not item:
            continue
        if item == "*":
            every = True
        elif known_ids is not None and item not in known_ids:
            if item not in unknown:
                unknown.append(item)
        else:
            ids.add(item)
    if unknown and known_ids is not None:
        problems.append(_unknown_ids(variable, unknown, known_ids))
    return ids, every


def _unknown_ids(variable: str, unknown: list[str], known_ids: frozenset[str]) -> str:
    """One message for every unknown id in ``variable``: the first few, each with its closest match."""
    import difflib

    named = []
    for item in unknown[:_NAMED]:
        close = difflib.get_close_matches(item[:SHOWN], sorted(known_ids), n=1, cutoff=0.6) if len(item) <= 200 else []
        named.append(_shown(item) + (f" (did you mean {close[0]!r}?)" if close else ""))
    more = f" and {len(unknown) - _NAMED} more" if len(unknown) > _NAMED else ""
    noun = "id" if len(unknown) == 1 else "ids"
    return (
        f"{variable} names unknown patch {noun} {', '.join(named)}{more}; ignored "
        "(`kvpatch status -v` lists every patch id)"
    )


def _shown(value: str) -> str:
    """``value`` quoted for a message, cut to :data:`SHOWN` characters (a 100 KB value is never echoed)."""
    if len(value) <= SHOWN:
        return repr(value)
    return f"{value[:SHOWN]!r}... ({len(value)} characters)"
