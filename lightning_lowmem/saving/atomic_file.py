"""Files written whole and never through a link: created fresh, synced, then renamed into place.

::

    write_new(path)        O_CREAT | O_EXCL | O_NOFOLLOW: whatever is at the name (a file, a link planted
                           there) is never opened; written, flushed, fsynced; removed again if the write fails
    replace_file(path)     written as '.lowmem-<random>.<name>' beside ``path`` (locked before any other save can
                           see it: ``temporaries.py``), then renamed over it and the directory fsynced: ``path``
                           holds the old bytes or the new ones, whatever the moment of a kill; a link at ``path``
                           is replaced, its target left as it was

:func:`step` marks each boundary of a save (a file written, a directory switched in); tests set ``_on_step``
to kill a save at each boundary.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from lightning_lowmem.errors import SaveError
from lightning_lowmem.saving.temporaries import _NEW, _UNSUPPORTED, _named, new_locked_file, remove_leftovers
from lightning_lowmem.memory.units import format_bytes
from lightning_lowmem.system import swap_call

log = logging.getLogger(__name__)

_on_step: Callable[[str], None] | None = None
"""Called with a label at each boundary of a save; for tests that interrupt a save there."""


def step(label: str) -> None:
    """A boundary of a save: ``label`` says what was just done (``"wrote model.safetensors"``)."""
    if _on_step is not None:
        _on_step(label)


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
    try:
        temporary, fd, lock = new_locked_file(path.parent, path.name, _old_mode(path))
    except OSError as e:  # no inode left, no permission: nothing was made
        raise _file_failed(e, path) from e
    try:
        with _filled(fd, temporary) as f:
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
    """Swap the two names ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``, macOS
    ``renamex_np(RENAME_SWAP)``).

    Returns:
        False where the system or the file system has no such call (nothing was changed).
    """
    return _rename(a, b, exchange=True)


def rename_new(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target``, which must not exist (``RENAME_NOREPLACE`` / ``RENAME_EXCL`` where there is
    one)."""
    if not _rename(source, target, exchange=False):
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, "appeared while the save ran", str(target))
        os.rename(source, target)


def _rename(a: Path, b: Path, *, exchange: bool) -> bool:
    swap = swap_call()
    if swap is None:
        return False
    if swap.call(os.fsencode(a), os.fsencode(b), swap.exchange if exchange else swap.noreplace) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


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
