"""Temporary files and directories of a save: their names, their locks, and the leftovers of killed saves.

Temporary names start with ``.lowmem-`` (``.lowmem-<8 hex>.<name>``), so no reader takes one for a checkpoint. A
save holds an advisory lock (``flock``) on its temporary file or directory while it runs, taken before another
save's clean-up can remove it: on Linux a file is made unnamed (``O_TMPFILE``), locked, then linked in; elsewhere,
and for a directory, it is created, locked, then checked to be still there (made again when a clean-up removed it
in between). The next save of the same name removes the leftovers of a killed one (:func:`remove_leftovers`), never
one that another save still holds.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from lightning_lowmem import system

log = logging.getLogger(__name__)

TEMPORARY_PREFIX = ".lowmem-"
"""How every temporary name of a save starts: a dot, so that no reader takes it for a checkpoint."""

_NAME_CHARS = 180  # of the target's name kept in a temporary name (a file name holds at most 255 bytes)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}


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


def new_locked_file(directory: Path, name: str, mode: int = 0o666) -> tuple[Path, int, int]:
    """A new temporary file of ``name`` in ``directory``, locked before another save's clean-up
    (:func:`remove_leftovers`) can remove it: ``(path, descriptor to write, descriptor holding the lock)``; close
    the lock's descriptor once the file is renamed into place.

    On Linux the file is made unnamed (``O_TMPFILE``), locked, then linked in: no process ever sees it unlocked.
    Elsewhere (or on a file system without ``O_TMPFILE``) it is created, locked, and checked to be still there:
    one a clean-up removed in between is made again.
    """
    made = _unnamed_then_linked(directory, name, mode) if system.O_TMPFILE is not None else None
    if made is not None:
        return made
    fds: list[int] = []
    path, lock = _locked_fresh(directory, name, lambda p: fds.append(os.open(p, _NEW, mode)),
                               lambda p: os.dup(fds[-1]))
    return path, fds[-1], lock


def make_locked_directory(directory: Path, name: str) -> tuple[Path, int]:
    """:func:`make_temporary_directory`, locked (a directory has no unnamed form: created, locked, checked to be still
    there, as :func:`new_locked_file` without ``O_TMPFILE``); ``(path, descriptor holding the lock)``."""
    return _locked_fresh(directory, name, lambda p: os.mkdir(p, 0o777),
                         lambda p: os.open(p, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)))


@contextlib.contextmanager
def holding(lock: int) -> Iterator[None]:
    """The block, then the lock's descriptor closed (the lock released)."""
    try:
        yield
    finally:
        os.close(lock)


def _locked_fresh(directory: Path, name: str, make: Callable[[Path], None],
                  open_lock: Callable[[Path], int]) -> tuple[Path, int]:
    """``make`` a fresh temporary, lock it, and check its name still holds it: a clean-up that locked it first removed
    it, and another is made."""
    for _ in range(100):
        path = _fresh(directory, name, make)
        lock = open_lock(path)
        _flock(lock, blocking=True)
        try:
            mine = os.fstat(lock)
            named = os.lstat(path)
            if (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino):
                return path, lock
        except FileNotFoundError:
            pass
        os.close(lock)
        log.info("%s was removed by another save's clean-up before it was locked; making another", path)
    raise FileExistsError(errno.EEXIST, "every temporary made was removed before it was locked", str(directory))


def _unnamed_then_linked(directory: Path, name: str, mode: int) -> tuple[Path, int, int] | None:
    """An unnamed file in ``directory``, locked, then linked in under a fresh temporary name; None where the file
    system (or a missing ``/proc``) does not allow it."""
    flags = system.O_TMPFILE | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(directory, flags, mode)
    except OSError as e:
        if e.errno in _UNSUPPORTED | {errno.EISDIR}:
            return None
        raise _named(e, directory) from None
    lock = os.dup(fd)
    _flock(lock, blocking=True)  # no other process can reach it yet: never waits
    at = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        for _ in range(100):
            name_in = temporary_name(name)
            try:  # linkat(AT_FDCWD, "/proc/self/fd/N", dir, name, AT_SYMLINK_FOLLOW): a dir_fd makes it linkat
                os.link(f"/proc/self/fd/{fd}", name_in, dst_dir_fd=at, follow_symlinks=True)
                return directory / name_in, fd, lock
            except FileExistsError:
                continue
            except OSError:  # no /proc: made the other way
                break
    finally:
        os.close(at)
    os.close(fd)
    os.close(lock)
    return None


def _named(error: BaseException, path: Path) -> BaseException:
    """``error`` with the file it concerns, when it is an ``OSError`` that names none."""
    if isinstance(error, OSError) and not error.filename:
        error.filename = str(path)
    return error
