"""kvpatch's state on disk, and the only code that reads or writes it. A state file is used only if it, its directory
and every directory above it (up to ``/``) is owned by the current user or root and not writable by group or others
(a directory may be if it is sticky, as ``/tmp`` is), the way ssh checks its files. The check and the use are one
step: directories are opened one component at a time from ``/`` (``O_NOFOLLOW``, each checked on its descriptor) and
files relative to the checked directory's descriptor, so what was checked is what is read or written. Symbolic links
are followed only in the path a user chose (``$KVPATCH_VERDICTS``, the cache root), resolved once, before the check.
Reads never block and take regular files of at most 4 MiB; writes are atomic and raise :class:`OSError` to the caller,
who degrades to memory with one warning."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from . import config
from ._warn import emit, quoted

try:  # POSIX; elsewhere locks are no-ops
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

MAX_BYTES = 4 << 20
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_SAFE_OPEN = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
#: A directory opened only to walk through it and to check it (``O_PATH`` needs no read permission: a home directory
#: of mode 0711 can be walked through, as ``open()`` can).
_DIR_OPEN = getattr(os, "O_PATH", os.O_RDONLY) | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | _CLOEXEC


class Place(NamedTuple):
    """A state directory and the directory kvpatch chose above it (symbolic links are followed up to there only)."""

    path: Path
    anchor: Path


class Untrusted(PermissionError):
    """A state directory or file another user could have written: never used (warned about once)."""


def cache_root() -> Path | None:
    """``$KVPATCH_CACHE``, else ``$XDG_CACHE_HOME/kvpatch``, else ``~/.cache/kvpatch`` (``None``: no home)."""
    if explicit := config.absolute_path(config.CACHE):
        return Path(explicit)
    try:
        return Path(config.absolute_path("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "kvpatch"
    except (RuntimeError, KeyError, OSError):  # HOME unset and no passwd entry for this uid
        return None


def env_dir() -> Place | None:
    """This environment's per-user place (``None``: no home directory)."""
    root = cache_root()
    if root is None or not root.is_absolute():  # ``~`` left unexpanded (no home)
        return None
    digest = hashlib.sha256(os.path.realpath(sys.prefix).encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return Place(root / "state" / digest, root)


def verdict_places() -> tuple[Place, ...]:
    """Where verdicts are read, earlier winning (the first usable one is written): ``$KVPATCH_VERDICTS``, else
    ``<sys.prefix>/var/cache/kvpatch`` if kvpatch is installed there (not --user/--target), and :func:`env_dir`."""
    if explicit := config.absolute_path(config.VERDICTS):
        path = Path(explicit)
        return (Place(path, path),)
    prefix = os.path.abspath(sys.prefix)
    var = Path(prefix) / "var"
    in_prefix = os.path.realpath(os.path.dirname(__file__)).startswith(os.path.join(os.path.realpath(prefix), ""))
    places = (Place(var / "cache" / "kvpatch", var) if in_prefix else None, env_dir())
    return tuple(p for p in places if p is not None)


def _trusted(st: os.stat_result, path: str, kind: str) -> None:
    """Raise :class:`Untrusted` unless ``st`` is owned by this user or root and only they can write to it."""
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    if uid is not None and st.st_uid not in (uid, 0):
        raise Untrusted(f"The {kind} {quoted(path)} is not owned by the current user (owner uid {st.st_uid})")
    if st.st_mode & 0o022 and not (kind == "directory" and st.st_mode & stat.S_ISVTX):
        raise Untrusted(f"The {kind} {quoted(path)} is writable by others")


def _walk(place: Place, *, create: bool) -> tuple[int, bool]:
    """A descriptor of ``place``'s directory, or of its deepest existing directory and False where the rest is missing
    (``create``: made, 0755); raises :class:`Untrusted` or :class:`OSError`. The caller closes the descriptor."""
    anchor = os.path.realpath(place.anchor)  # the links in the path the user chose: resolved once, here
    below = place.path.relative_to(place.anchor).parts if place.path != place.anchor else ()
    parts = [p for p in Path(anchor).parts[1:] if p] + list(below)
    fd = os.open("/", _DIR_OPEN)
    shown = "/"
    try:
        _trusted(os.fstat(fd), shown, "directory")
        for name in parts:
            shown = os.path.join(shown, name)
            try:
                child = os.open(name, _DIR_OPEN, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    return fd, False
                with contextlib.suppress(FileExistsError):  # another process made it meanwhile: checked below
                    os.mkdir(name, 0o755, dir_fd=fd)
                child = _open_dir(name, fd, shown)
            except OSError as exc:
                raise _why(exc, shown) from None
            os.close(fd)
            fd = child
            st = os.fstat(fd)
            if not stat.S_ISDIR(st.st_mode):  # pragma: no cover - O_DIRECTORY refuses it first
                raise Untrusted(f"{quoted(shown)} is not a directory")
            _trusted(st, shown, "directory")
        return fd, True
    except BaseException:
        os.close(fd)
        raise


def _open_dir(name: str, fd: int, shown: str) -> int:
    try:
        return os.open(name, _DIR_OPEN, dir_fd=fd)
    except OSError as exc:
        raise _why(exc, shown) from None


def _why(exc: OSError, shown: str) -> OSError:
    """The refusal a failed directory open means: a symbolic link or a file is a matter of trust, no entry is not."""
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return Untrusted(f"{quoted(shown)} is not a directory (a symbolic link or a file)")
    return OSError(exc.errno, f"The directory {quoted(shown)} cannot be entered ({exc.strerror or exc})")


class Directory(NamedTuple):
    """A state directory opened and checked (:func:`opened`): all it reads and writes go through its descriptor."""

    fd: int | None  # None: it does not exist (opened without ``create``)
    place: Place
    what: str

    def _shown(self, name: str) -> str:
        return str(self.place.path / name)

    def read_json(self, name: str) -> Any:
        """The JSON document ``name`` (``None``: absent, refused, unreadable or corrupt). Never raises."""
        with contextlib.suppress(Exception):
            data = None if self.fd is None else _read(name, self.fd, self._shown(name), owned=self.what)
            return None if data is None else json.loads(data)
        return None

    def write_json(self, name: str, data: Any) -> None:
        """Atomically replace ``name`` with ``data`` as JSON. Raises :class:`OSError` if not written."""
        fd = self._needed()
        payload = json.dumps(data, separators=(",", ":"), sort_keys=True, default=str).encode("utf-8")
        tmp = f".{name}.{os.urandom(6).hex()}.tmp"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _SAFE_OPEN, 0o600, dir_fd=fd)
        try:
            with os.fdopen(out, "wb") as file:
                os.fchmod(out, 0o644)  # readable by the environment's other users (a verdict stored at build time)
                file.write(payload)
                file.flush()
                os.fsync(out)
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            raise

    @contextlib.contextmanager
    def locked(self, name: str, *, wait: bool) -> Iterator[int | None]:
        """Lock ``name`` for the block, yielding its descriptor (``None``: ``wait`` off and the lock taken)."""
        fd = self.open(name, os.O_RDWR)
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

    def open(self, name: str, flags: int) -> int:
        """``name`` opened with ``flags`` (created 0600), this user's or root's only (a refusal warned about once)."""
        try:
            return _open(name, flags | os.O_CREAT, self._needed(), shown=self._shown(name), owned=True)
        except Untrusted as exc:
            _warn_untrusted(exc, self._shown(name), self.what)
            raise

    def _needed(self) -> int:
        if self.fd is None:
            raise FileNotFoundError(errno.ENOENT, "no such directory", str(self.place.path))
        return self.fd


@contextlib.contextmanager
def opened(place: Place, what: str = "state", *, create: bool) -> Iterator[Directory]:
    """``place`` opened and checked for the block (``create``: made where missing). A refusal on trust is warned
    about once; it and any other failure raise :class:`OSError`."""
    if os.open not in os.supports_dir_fd:  # pragma: no cover - not POSIX: no way to check what is opened
        raise OSError(errno.ENOTSUP, "kvpatch keeps no state on this platform")
    try:
        fd, found = _walk(place, create=create)
    except Untrusted as exc:
        _warn_untrusted(exc, place.path, what)
        raise
    try:
        yield Directory(fd if found else None, place, what)
    finally:
        os.close(fd)


def _warn_untrusted(exc: Untrusted, path: Path | str, what: str) -> None:
    emit(f"{exc}; kvpatch does not use it and keeps its {what} in memory", key=f"store:{path}")


def untrusted(place: Place) -> bool:
    """Whether ``place`` fails the trust check (owner, mode, a symbolic link below the chosen directory)."""
    try:
        os.close(_walk(place, create=False)[0])
    except Untrusted:
        return True
    except OSError:
        pass
    return False


def usable(place: Place, what: str = "state") -> bool:
    """``place`` passes the trust check (warns once if not) and exists or can be created and written."""
    with contextlib.suppress(Exception):  # PermissionError and friends: not usable
        fd, _ = _walk(place, create=False)
        try:
            return os.access(".", os.W_OK | os.X_OK, dir_fd=fd)
        finally:
            os.close(fd)
    with contextlib.suppress(Exception), opened(place, what, create=False):  # to warn (once) about a refusal
        pass
    return False


def _open(name: str, flags: int, dir_fd: int | None = None, *, shown: str, owned: bool = False) -> int:
    """``os.open`` that follows no symbolic link, never blocks on a FIFO, and accepts only regular files (``owned``:
    only one this user or root owns and only they can write to: :class:`Untrusted` otherwise)."""
    fd = os.open(name, flags | _SAFE_OPEN, 0o600, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", shown)
        if owned:
            _trusted(st, shown, "file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read(name: str, dir_fd: int | None, shown: str, *, owned: str | None) -> bytes | None:
    """The bytes of a regular file of at most :data:`MAX_BYTES` (``None``: absent, refused or unreadable; ``owned``:
    state, what it holds, refused unless this user's or root's)."""
    try:
        with os.fdopen(_open(name, os.O_RDONLY, dir_fd, shown=shown, owned=owned is not None), "rb") as file:
            data = file.read(MAX_BYTES + 1)
        if len(data) <= MAX_BYTES:
            return data
        why = f"larger than {MAX_BYTES} bytes"
    except FileNotFoundError:
        return None
    except Untrusted as exc:
        _warn_untrusted(exc, shown, owned or "state")
        return None
    except OSError as exc:  # a symlink (ELOOP), a FIFO or device, no permission
        why = "a symbolic link (not followed)" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
    emit(f"kvpatch ignores {quoted(shown)}: {why}", key=f"store-read:{shown}")
    return None


def read_bytes(path: Path) -> bytes | None:
    """The bytes of a regular file of at most :data:`MAX_BYTES` that is not state (a source file kvpatch scans)."""
    return _read(str(path), None, str(path), owned=None)


def read_json(place: Place, name: str, what: str = "state") -> Any:
    with contextlib.suppress(Exception), opened(place, what, create=False) as directory:
        return directory.read_json(name)
    return None


def write_json(place: Place, name: str, data: Any, what: str = "state") -> None:
    with opened(place, what, create=True) as directory:
        directory.write_json(name, data)


@contextlib.contextmanager
def locked(place: Place, name: str, *, wait: bool, what: str = "state") -> Iterator[int | None]:
    with opened(place, what, create=True) as directory, directory.locked(name, wait=wait) as fd:
        yield fd
