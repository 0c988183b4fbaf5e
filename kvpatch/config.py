"""Every environment variable kvpatch reads (``docs/configuration.md`` is their table; ``KVPATCH`` is read by the
bootstrap, which :func:`is_off` asks). A malformed value never raises: :attr:`Config.problems` says it."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ._site import boot as _boot
from ._warn import emit

SHOWN = 60  # the most characters of one environment value a message quotes
_NAMED = 3  # the most unknown ids one message names
ON_VALUES = frozenset({"", "on", "1", "true", "yes", "enable", "enabled", "auto"})
#: ``KVPATCH_VERIFY``'s values that turn background verification off.
NEVER = frozenset({"never", "off", "0", "no", "false"})

VERIFY = "KVPATCH_VERIFY"
VERDICTS = "KVPATCH_VERDICTS"
CACHE = "KVPATCH_CACHE"
VENDORED = "KVPATCH_VENDORED"
VERIFYING = "KVPATCH_VERIFYING"  # set by kvpatch for a verification process (the background child, ``verify``)
#: Every variable a user sets (what an import does depends on each: ``kvpatch.settle`` keys on all of them).
VARIABLES = ("KVPATCH", "KVPATCH_DISABLE", "KVPATCH_ENABLE", "KVPATCH_ENFORCE", VERIFY, VERDICTS, CACHE, VENDORED)
#: The variables that name a directory (read through :func:`absolute_path`).
PATHS = (VERDICTS, CACHE, "XDG_CACHE_HOME")


def __getattr__(name: str) -> frozenset[str]:
    """``OFF_VALUES``: ``KVPATCH``'s off values, the bootstrap's (read on use: a kvpatch whose bootstrap is missing
    still imports, and says so when it activates)."""
    if name == "OFF_VALUES":
        return _off_values()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _off_values() -> frozenset[str]:
    return frozenset(_boot().OFF_VALUES)


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
    if raw.strip().lower() not in ON_VALUES | _off_values():
        problems.append(f"KVPATCH_ENFORCE={_shown(raw)} is not understood (use 1 or 0); not enforcing")
    enforcing = raw.strip().lower() in ON_VALUES - {""}
    raw = env.get(VERIFY, "")
    if raw.strip().lower() not in ON_VALUES | NEVER:
        problems.append(f"{VERIFY}={_shown(raw)} is not understood (use 'never' or 'auto'); verification stays on")
    if bad := _vendored(env)[1]:
        listed = ", ".join(map(_shown, bad[:_NAMED])) + (f" and {len(bad) - _NAMED} more" if len(bad) > _NAMED else "")
        problems.append(f"{VENDORED} names {listed}, not module names; ignored")
    problems += [why for name in PATHS if (why := _relative(name, env)) is not None]
    return Config(enabled, disabled, disable_all, enforcing, tuple(problems), opted, enable_all)


def is_off(environ: Mapping[str, str] | None = None) -> bool:
    """``KVPATCH=off``: kvpatch does nothing in this process (the bootstrap's one reading of it)."""
    return bool(_boot().is_off(environ))


def background_verification() -> bool:
    """Whether a process without a verdict may start a background verification (``KVPATCH_VERIFY``)."""
    return os.environ.get(VERIFY, "").strip().lower() not in NEVER


def _setting(name: str) -> Callable[[], str | None]:
    """A reader of ``name``: its value where set and not empty, else None (read at each call)."""
    return lambda: os.environ.get(name) or None


verifying = _setting(VERIFYING)


def absolute_path(name: str) -> str | None:
    """The directory ``name`` (one of :data:`PATHS`) names, ``~`` expanded, read at each call; ``None`` where it is
    unset, empty or relative. A relative one would name another directory in each working directory (and the
    background verifier's is ``/``): it is ignored, with one warning."""
    raw = os.environ.get(name)
    if not raw:
        return None
    path = os.path.expanduser(raw)
    if os.path.isabs(path):
        return path
    why = _relative(name, os.environ)
    emit(str(why), key=f"config:{why}")  # the engine warns its problems under the same key: said once
    return None


def _relative(name: str, env: Mapping[str, str]) -> str | None:
    raw = env.get(name)
    if not raw or os.path.isabs(os.path.expanduser(raw)):
        return None
    return f"{name}={_shown(raw)} is a relative path; ignored (set an absolute one)"


def vendored() -> str:
    """``KVPATCH_VENDORED`` as set, stripped (:func:`vendored_modules` parses it)."""
    return os.environ.get(VENDORED, "").strip()


def vendored_modules() -> list[str] | None:
    """The modules ``KVPATCH_VENDORED`` names besides the copies kvpatch knows of (``None``: off)."""
    return _vendored(os.environ)[0]


def _vendored(env: Mapping[str, str]) -> tuple[list[str] | None, list[str]]:
    """``KVPATCH_VENDORED``'s modules (``None``: off) and the items that are no module name (ignored)."""
    raw = env.get(VENDORED, "").strip()
    if not raw or raw.lower() in _off_values():
        return None, []
    items = [n.strip() for n in raw.split(",") if n.strip().lower() not in {*ON_VALUES, "all"}]
    names = [n for n in items if all(part.isidentifier() for part in n.split("."))]
    return names, [n for n in items if n not in names]


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
