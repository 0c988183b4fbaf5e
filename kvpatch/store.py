"""kvpatch's state on disk, and the only code that reads or writes it. A directory is used only if it and each parent
up to the one kvpatch chose is a real directory owned by the current user or root and not writable by group or others
unless sticky (as ssh and pip check theirs). Reads follow no symlink, never block and take regular files of at most
4 MiB; writes are atomic and raise :class:`OSError` to the caller, who degrades to memory with one warning."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from . import config
from ._warn import emit

try:  # POSIX; elsewhere locks are no-ops
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

MAX_BYTES = 4 << 20
_SAFE_OPEN = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


class Place(NamedTuple):
    """A state directory and the directory kvpatch chose above it (the trust check stops there)."""

    path: Path
    anchor: Path


def cache_root() -> Path | None:
    """``$KVPATCH_CACHE``, else ``$XDG_CACHE_HOME/kvpatch``, else ``~/.cache/kvpatch`` (``None``: no home)."""
    if explicit := config.cache_override():
        return Path(explicit).expanduser()
    try:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "kvpatch"
    except (RuntimeError, KeyError, OSError):  # HOME unset and no passwd entry for this uid
        return None


def env_dir() -> Place | None:
    """This environment's per-user place (``None``: no home directory)."""
    root = cache_root()
    if root is None:
        return None
    digest = hashlib.sha256(os.path.realpath(sys.prefix).encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return Place(root / "state" / digest, root)


def verdict_places() -> tuple[Place, ...]:
    """Where verdicts are read, earlier winning (the first usable one is written): ``$KVPATCH_VERDICTS``, else
    ``<sys.prefix>/var/cache/kvpatch`` if kvpatch is installed there (not --user/--target), and :func:`env_dir`."""
    if explicit := config.verdicts_override():
        path = Path(explicit).expanduser()
        return (Place(path, path),)
    var = Path(sys.prefix) / "var"
    in_prefix = os.path.realpath(os.path.dirname(__file__)).startswith(os.path.join(os.path.realpath(sys.prefix), ""))
    places = (Place(var / "cache" / "kvpatch", var) if in_prefix else None, env_dir())
    return tuple(p for p in places if p is not None)


def _check(place: Place) -> tuple[str, bool] | None:
    """Why ``place`` must not be used and whether that is a matter of trust (``None``: it may be used)."""
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    for path in (place.path, *place.path.parents):
        try:
            st = os.stat(path) if path == place.anchor else os.lstat(path)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            return f"The directory {path} cannot be entered ({exc.strerror or exc})", False
        if st is not None:
            if not stat.S_ISDIR(st.st_mode):
                return f"{path} is not a directory", True
            if uid is not None and st.st_uid not in (uid, 0):
                return f"The directory {path} is not owned by the current user (owner uid {st.st_uid})", True
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                return f"The directory {path} is writable by others", True
        if path == place.anchor or place.anchor not in path.parents:
            break
    return None


def untrusted(place: Place) -> bool:
    """Whether ``place`` fails the trust check (owner, mode, a symlinked part): warned about once when used."""
    return (_check(place) or ("", False))[1]


def _refused(place: Place, what: str) -> str | None:
    """Why ``place`` must not be used (``None``: it may be); warned once if a matter of trust, else left to callers."""
    found = _check(place)
    if found and found[1]:
        emit(f"{found[0]}; kvpatch does not use it and keeps its {what} in memory", key=f"store:{place.path}")
    return found[0] if found else None


def usable(place: Place, what: str = "state") -> bool:
    """``place`` passes the trust check (warns once if not) and exists or can be created and written."""
    with contextlib.suppress(Exception):  # PermissionError and friends: not usable
        if not _refused(place, what):
            path = next(p for p in (place.path, *place.path.parents) if os.path.lexists(p))
            return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)
    return False


def _open(path: Path, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that follows no symlink, never blocks on a FIFO, and accepts only regular files."""
    fd = os.open(path, flags | _SAFE_OPEN, mode)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


def read_bytes(path: Path) -> bytes | None:
    """The bytes of a regular file of at most :data:`MAX_BYTES` (``None``: absent, refused or unreadable)."""
    try:
        with os.fdopen(_open(path, os.O_RDONLY), "rb") as file:
            data = file.read(MAX_BYTES + 1)
        if len(data) <= MAX_BYTES:
            return data
        why = f"larger than {MAX_BYTES} bytes"
    except FileNotFoundError:
        return None
    except OSError as exc:  # a symlink (ELOOP), a FIFO or device, no permission
        why = "a symbolic link (not followed)" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
    emit(f"kvpatch ignores {path}: {why}", key=f"store-read:{path}")
    return None


def read_json(place: Place, name: str, what: str = "state") -> Any:
    """The JSON document ``name`` in ``place`` (``None``: absent, refused, unreadable or corrupt). Never raises."""
    with contextlib.suppress(Exception):
        data = None if _refused(place, what) else read_bytes(place.path / name)
        return None if data is None else json.loads(data)
    return None


def _ensure(place: Place, what: str) -> None:
    """Create ``place`` if needed (0755), checked before and after; raise :class:`OSError` if it must not be used."""
    for create in (True, False):
        if why := _refused(place, what):
            raise PermissionError(errno.EACCES, why, str(place.path))
        if create:
            os.makedirs(place.path, mode=0o755, exist_ok=True)


def write_json(place: Place, name: str, data: Any, what: str = "state") -> None:
    """Atomically replace ``name`` in ``place`` with ``data`` as JSON. Raises :class:`OSError` if not written."""
    _ensure(place, what)
    payload = json.dumps(data, separators=(",", ":"), sort_keys=True, default=str).encode("utf-8")
    fd, tmp = tempfile.mkstemp(dir=place.path, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            os.fchmod(fd, 0o644)  # readable by the environment's other users (a verdict stored at build time)
            file.write(payload)
            file.flush()
            os.fsync(fd)
        os.replace(tmp, place.path / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def locked(place: Place, name: str, *, wait: bool, what: str = "state") -> Iterator[int | None]:
    """Lock ``name`` in ``place`` for the block, yielding its descriptor (``None``: ``wait`` off and the lock taken)."""
    _ensure(place, what)
    fd = _open(place.path / name, os.O_RDWR | os.O_CREAT)
    try:
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield None
        else:
            yield fd
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def open_log(place: Place, name: str, what: str = "state") -> int:
    """``name`` in ``place`` opened for appending (created 0600, no symlink followed). Raises :class:`OSError`."""
    _ensure(place, what)
    return _open(place.path / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
