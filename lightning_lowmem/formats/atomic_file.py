"""Files written whole and never through a link: created fresh, synced, then renamed into place.

::

    write_new(path)        O_CREAT | O_EXCL | O_NOFOLLOW: whatever is at the name (a file, a link planted
                           there) is never opened; written, flushed, fsynced; removed again if the write fails
    replace_file(path)     written as '.lowmem-<random>.<name>' beside ``path``, then renamed over it and the
                           directory fsynced: ``path`` holds the old bytes or the new ones, whatever the moment
                           of a kill; a link at ``path`` is replaced, its target left as it was

Temporary names start with ``.lowmem-``, so no reader takes one for a checkpoint. A save holds an advisory
lock (``flock``) on its temporary file or directory while it runs; the next save of the same name removes the
leftovers of a killed one (:func:`remove_leftovers`), never one that another save still holds.

:func:`step` marks each boundary of a save (a file written, a directory switched in); tests set ``_on_step``
to kill a save at each boundary.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from lightning_lowmem.errors import SaveError
from lightning_lowmem.memory.units import format_bytes

log = logging.getLogger(__name__)

TEMPORARY_PREFIX = ".lowmem-"
"""How every temporary name of a save starts: a dot, so that no reader takes it for a checkpoint."""

_NAME_CHARS = 180  # of the target's name kept in a temporary name (a file name holds at most 255 bytes)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}

_on_step: Callable[[str], None] | None = None
"""Called with a label at each boundary of a save; for tests that interrupt a save there."""


def step(label: str) -> None:
    """A boundary of a save: ``label`` says what was just done (``"wrote model.safetensors"``)."""
    if _on_step is not None:
        _on_step(label)


def temporary_name(name: str, *, old: bool = False) -> str:
    """A fresh temporary name for ``name``: ``.lowmem-<8 hex>.<name>``, or ``.lowmem-old-<8 hex>.<name>`` for the
    old content of a directory moved aside (where no atomic exchange exists)."""
    return f"{TEMPORARY_PREFIX}{'old-' if old else ''}{secrets.token_hex(4)}.{name[:_NAME_CHARS]}"


def leftover_pattern(name: str, *, old: bool | None = None) -> re.Pattern[str]:
    """The temporary names of ``name`` (:func:`temporary_name`): only the old ones (``old=True``), only the new
    ones (False), or both (None)."""
    kind = {None: "(?:old-)?", True: "old-", False: ""}[old]
    return re.compile(re.escape(TEMPORARY_PREFIX) + kind + "[0-9a-f]{8}\\." + re.escape(name[:_NAME_CHARS]))


@contextlib.contextmanager
def write_new(path: Path, mode: int = 0o666) -> Iterator[BinaryIO]:
    """``path`` created for the caller to write (nothing there may exist: a link is never followed), then flushed,
    fsynced and closed; removed again if anything fails. Marks the boundary with :func:`step`.

    Raises:
        FileExistsError: something (a file, a link) is at ``path``.
        OSError: the write failed (``filename`` set to ``path``).
    """
    try:
        fd = os.open(path, _NEW, mode)
    except OSError as e:
        raise _named(e, path) from None
    with _filled(fd, path) as f:
        yield f
    step(f"wrote {path.name}")


@contextlib.contextmanager
def _filled(fd: int, path: Path) -> Iterator[BinaryIO]:
    """The new file ``fd`` (at ``path``) for the caller to write, then flushed, fsynced and closed; ``path`` is
    removed again if anything fails."""
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(path)  # ours: created by the caller with O_EXCL
        raise _named(e, path)


def copy_new(source: Path, path: Path) -> None:
    """``source``'s bytes (read through any link) into the new file ``path`` (:func:`write_new`), with its mode."""
    fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO never blocks it
    with os.fdopen(fd, "rb") as src:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(source))
        with write_new(path, stat.S_IMODE(info.st_mode)) as dst:
            shutil.copyfileobj(src, dst, 2**20)


def replace_file(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Write the file ``path`` whole: ``write`` fills a new temporary file beside it, which is then renamed over
    ``path`` (a link there is replaced, never followed) and the directory fsynced. ``path`` keeps the mode of
    the file it replaces. Leftovers of a killed earlier call are removed first.

    Raises:
        ValueError: ``path`` is a directory.
        SaveError: the write failed (no space, no permission; it names the file and the bytes free); ``path`` is
            as it was and no temporary file is left. Any other error of ``write`` passes as it is.
    """
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        raise ValueError(f"{str(path)!r} is a directory; a single-file save needs a file name (e.g. "
                         f"{str(path / 'checkpoint.ckpt')!r}).")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path.parent, path.name)
    fds: list[int] = []
    temporary = _fresh(path.parent, path.name, lambda p: fds.append(os.open(p, _NEW, _old_mode(path))))
    lock = os.dup(fds[0])  # the lock lives until the rename: closing the written file must not drop it
    try:
        _flock(lock, blocking=True)
        with _filled(fds[0], temporary) as f:
            write(f)
        os.replace(temporary, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(e, OSError) and not isinstance(e, SaveError):
            raise _file_failed(e, path) from e
        raise
    finally:
        os.close(lock)
    fsync_directory(path.parent)
    step(f"replaced {path.name}")


def _file_failed(error: OSError, path: Path) -> SaveError:
    try:
        free: int | None = free_bytes(path.parent)
    except OSError:
        free = None
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        advice = f"{'An unknown amount' if free is None else format_bytes(free)} is free there now: free some space"
    else:
        advice = "Fix the cause (a permission, a read-only file system)"
    return SaveError(f"Writing {path} failed at {error.filename or path}: {error.strerror or error}. {path} holds "
                     f"what it held before and no temporary file is left. {advice}, or save elsewhere.",
                     path=str(path), available=free, errno=error.errno)


def fsync_directory(path: Path) -> None:
    """Make the names in ``path`` (files created, renamed, removed) durable; file systems that cannot sync a
    directory (EINVAL) are left as they are."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def exchange(a: Path, b: Path) -> bool:
    """Swap the two names ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns:
        False where the system or the file system has no such call (nothing was changed).
    """
    return _renameat2(a, b, _RENAME_EXCHANGE)


def rename_new(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target``, which must not exist (``RENAME_NOREPLACE`` where there is one)."""
    if not _renameat2(source, target, _RENAME_NOREPLACE):
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, "appeared while the save ran", str(target))
        os.rename(source, target)


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    call = _libc_renameat2()
    if call is None:
        return False
    at_cwd = -100  # AT_FDCWD
    if call(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An advisory lock on ``path`` (a file or a directory) held while the block runs: it tells
    :func:`remove_leftovers` that the temporary is in use."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        _flock(fd, blocking=True)
        yield
    finally:
        os.close(fd)  # releases the lock


def remove_leftovers(directory: Path, name: str) -> list[str]:
    """Remove the temporaries of ``name`` in ``directory`` that no running save holds: what a killed save left
    (a link planted at such a name is removed too, never followed). Returns the names removed."""
    pattern, removed = leftover_pattern(name), []
    try:
        entries = [e for e in os.scandir(directory) if pattern.fullmatch(e.name)]
    except FileNotFoundError:
        return []
    for entry in entries:
        try:
            if _remove_unless_held(entry):
                removed.append(entry.name)
        except OSError as e:  # not ours to remove (another user's), or gone meanwhile: the save goes on
            log.warning("Could not remove %s, left by an interrupted save: %s", entry.path, e)
    if removed:
        log.info("Removed %d leftovers of interrupted saves in %s: %s", len(removed), directory, removed)
    return removed


def _remove_unless_held(entry: os.DirEntry) -> bool:
    """Remove ``entry`` (a link itself, never its target) unless a running save holds it; whether it was removed."""
    path = Path(entry.path)
    if entry.is_symlink():
        os.unlink(path)
        return True
    with _unless_held(path) as free:
        if free and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(path)
        elif free:
            os.unlink(path)
        return free


@contextlib.contextmanager
def _unless_held(path: Path) -> Iterator[bool]:
    """True (and the lock held through the block) when no save holds ``path``; False when one does."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        yield False
        return
    try:
        yield _flock(fd, blocking=False)
    finally:
        os.close(fd)


def _flock(fd: int, *, blocking: bool) -> bool:
    try:
        import fcntl
    except ImportError:  # no advisory locks (not POSIX): every leftover counts as free
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


def _fresh(directory: Path, name: str, make: Callable[[Path], None]) -> Path:
    """``make`` a fresh temporary of ``name`` in ``directory``; a name already taken (even by a link) is skipped."""
    for _ in range(100):
        candidate = directory / temporary_name(name)
        try:
            make(candidate)
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name after 100 tries", str(directory))


def make_temporary_directory(directory: Path, name: str) -> Path:
    """A new empty directory ``.lowmem-<random>.<name>`` in ``directory`` (umask applied)."""
    return _fresh(directory, name, lambda p: os.mkdir(p, 0o777))


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged user may still write on the file system of ``path`` (or of its nearest existing parent)."""
    info = os.statvfs(existing_parent(path))
    return info.f_bavail * info.f_frsize


def block_size(path: Path) -> int:
    """The allocation unit of the file system of ``path`` (or of its nearest existing parent)."""
    return os.statvfs(existing_parent(path)).f_frsize or 4096


def existing_parent(path: Path) -> Path:
    """``path`` itself when it exists, else its nearest existing parent."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _old_mode(path: Path) -> int:
    """The permission bits of the regular file at ``path`` (not of a link), else 0o666 (the umask applies)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return 0o666
    return stat.S_IMODE(info.st_mode) if stat.S_ISREG(info.st_mode) else 0o666


def _named(error: BaseException, path: Path) -> BaseException:
    """``error`` with the file it concerns, when it is an ``OSError`` that names none."""
    if isinstance(error, OSError) and not error.filename:
        error.filename = str(path)
    return error


_RENAMEAT2: list = []


def _libc_renameat2() -> Callable[..., int] | None:
    """glibc's ``renameat2`` (2.28 and later), or None where there is none."""
    if not _RENAMEAT2:
        try:
            call = ctypes.CDLL(None, use_errno=True).renameat2
            call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            call.restype = ctypes.c_int
        except (AttributeError, OSError, TypeError):
            call = None
        _RENAMEAT2.append(call)
    return _RENAMEAT2[0]
