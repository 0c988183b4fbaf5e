"""Every environment variable kvpatch reads (``docs/configuration.md`` is their table; ``KVPATCH`` is read by the
bootstrap, which :func:`is_off` asks). A malformed value never raises: :attr:`Config.problems` says it."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ._site import boot as _boot

SHOWN = 60  # the most characters of one environment value a message quotes
_NAMED = 3  # the most unknown ids one message names
OFF_VALUES = frozenset(_boot().OFF_VALUES)
ON_VALUES = frozenset({"", "on", "1", "true", "yes", "enable", "enabled", "auto"})

VERIFY = "KVPATCH_VERIFY"
VERDICTS = "KVPATCH_VERDICTS"
CACHE = "KVPATCH_CACHE"
VENDORED = "KVPATCH_VENDORED"
VERIFYING = "KVPATCH_VERIFYING"  # set by kvpatch for a verification process (the background child, ``verify``)
#: Every variable a user sets (what an import does depends on each: ``kvpatch.settle`` keys on all of them).
VARIABLES = ("KVPATCH", "KVPATCH_DISABLE", "KVPATCH_ENABLE", "KVPATCH_ENFORCE", VERIFY, VERDICTS, CACHE, VENDORED)


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
    env = os.environ if environ is None else environ
    problems: list[str] = []
    raw = env.get("KVPATCH", "")
    enabled = not is_off(env)
    if enabled and raw.strip().lower() not in ON_VALUES:
        problems.append(f"KVPATCH={_shown(raw)} is not understood (use 'off' or 'on'); kvpatch stays on")
    disabled, disable_all = _ids(env, "KVPATCH_DISABLE", known_ids, problems)
    opted, enable_all = _ids(env, "KVPATCH_ENABLE", known_ids, problems)
    raw = env.get("KVPATCH_ENFORCE", "")
    if raw.strip().lower() not in ON_VALUES | OFF_VALUES:
        problems.append(f"KVPATCH_ENFORCE={_shown(raw)} is not understood (use 1 or 0); not enforcing")
    enforcing = raw.strip().lower() in ON_VALUES - {""}
    return Config(enabled, disabled, disable_all, enforcing, tuple(problems), opted, enable_all)


def is_off(environ: Mapping[str, str] | None = None) -> bool:
    """``KVPATCH=off``: kvpatch does nothing in this process (the bootstrap's one reading of it)."""
    return bool(_boot().is_off(environ))


def background_verification() -> bool:
    """Whether a process without a verdict may start a background verification (``KVPATCH_VERIFY``)."""
    return os.environ.get(VERIFY, "").strip().lower() not in {"never", "off", "0", "no", "false"}


def _setting(name: str) -> Callable[[], str | None]:
    """A reader of ``name``: its value where set and not empty, else None (read at each call)."""
    return lambda: os.environ.get(name) or None


verifying = _setting(VERIFYING)
verdicts_override = _setting(VERDICTS)
cache_override = _setting(CACHE)


def vendored() -> str:
    """``KVPATCH_VENDORED`` as set, stripped; :func:`kvpatch.vendored.setting` parses it."""
    return os.environ.get(VENDORED, "").strip()


def values() -> list[tuple[str, str | None]]:
    return [(name, os.environ.get(name)) for name in VARIABLES]


def _ids(
    env: Mapping[str, str], variable: str, known_ids: frozenset[str] | None, problems: list[str]
) -> tuple[frozenset[str], bool]:
    """The ids a comma-separated variable names, and whether it says ``*``; unknown ids make one message."""
    names = dict.fromkeys(item.strip().lower() for item in env.get(variable, "").split(","))
    ids = [name for name in names if name not in ("", "*")]
    if known_ids is not None and (unknown := [name for name in ids if name not in known_ids]):
        import difflib

        named = []
        for item in unknown[:_NAMED]:
            close = difflib.get_close_matches(item[:SHOWN], sorted(known_ids), n=1) if len(item) <= 200 else []
            named.append(_shown(item) + (f" (did you mean {close[0]!r}?)" if close else ""))
        listed = ", ".join(named) + (f" and {len(unknown) - _NAMED} more" if len(unknown) > _NAMED else "")
        noun = "id" if len(unknown) == 1 else "ids"
        problems.append(
            f"{variable} names unknown patch {noun} {listed}; ignored (`kvpatch status -v` lists every patch id)"
        )
        ids = [name for name in ids if name in known_ids]
    return frozenset(ids), "*" in names


def _shown(value: str) -> str:
    """``value`` quoted for a message, cut to :data:`SHOWN` characters."""
    return repr(value) if len(value) <= SHOWN else f"{value[:SHOWN]!r}... ({len(value)} characters)"
