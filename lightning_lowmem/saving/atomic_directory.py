"""A directory's content replaced as a whole: the new content is written beside it, then switched in at once.

::

    parent/.lowmem-<random>.<name>/   made fresh; the save writes its files into it, each created with
                                      O_CREAT | O_EXCL | O_NOFOLLOW, flushed and fsynced
    sealed                            every file in it fsynced (those a third-party writer made too); what the
                                      old directory holds beyond the save carried over (files as hard links, or
                                      copies where the file system has none; links as the same links; folders
                                      as folders); the old directory's permission bits; the directory fsynced
    switched                          renameat2(RENAME_EXCHANGE) swaps the two names in one step; parent fsynced
    old content removed               and with it the files of the old save that the new one does not have

``<name>`` is the complete old directory until the exchange and the complete new one after it, whatever the
moment of a kill or a full disk. A failed save removes its temporary directory; one a kill left is removed by
the next save of the same name. Where the system has no exchange (not Linux, or a file system without it), the
old directory is renamed aside (``.lowmem-old-<random>.<name>``) and the new one renamed in: between those two
renames ``<name>`` does not exist, and if a kill falls there the next save first puts the old directory back.

Files added to the old directory by another program while a save runs are not carried over.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from lightning_lowmem.errors import SaveError
from lightning_lowmem.saving.atomic_file import (
    block_size,
    copy_new,
    exchange,
    existing_parent,
    free_bytes,
    fsync_directory,
    rename_new,
    step,
)
from lightning_lowmem.saving.temporaries import (
    TEMPORARY_PREFIX,
    holding,
    leftover_pattern,
    make_locked_directory,
    remove_leftovers,
    temporary_name,
)
from lightning_lowmem.memory.units import format_bytes
from lightning_lowmem.system import is_mount_point

log = logging.getLogger(__name__)

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NO_PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)


def _carry_all(entry: os.DirEntry) -> bool:
    return False


@contextlib.contextmanager
def switch_directory(target: str | Path, *, sizes: Sequence[int] = (),
                     drop: Callable[[os.DirEntry], bool] = _carry_all) -> Iterator[Path]:
    """A new, empty directory beside ``target`` for the caller to fill; switched in as ``target`` when the block
    ends without an error, removed when it raises.

    Args:
        target: the directory to replace (made if missing). A link to a directory is followed once: the
            directory it names is replaced.
        sizes: bytes of the files the caller will write, for the free-space check made before anything is
            written.
        drop: entries of the old directory (its top level) not to carry over besides the names the caller
            writes; temporaries (``.lowmem-*``) are never carried.

    Raises:
        SaveError: the parent is not writable, ``target`` is a mount point, there is not enough free space, or
            a write failed (it names the file, the bytes needed and free); ``target`` is as it was.
    """
    target = resolved_target(target)
    needed = 0
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tidy(target)
        needed = check_switchable(target, sizes)
        staging, lock = make_locked_directory(target.parent, target.name)
    except SaveError:
        raise
    except OSError as e:
        raise failed(e, target, needed) from e
    old: Path | None = None
    switched = False
    try:
        with holding(lock):
            step("staged")
            yield staging
            _seal(staging)
            _carry(target, staging, drop)
            _set_mode(staging, target)
            fsync_directory(staging)
            step("sealed")
            old, switched = _switch(staging, target), True
    except BaseException as e:
        file = _file_in(e, staging, target) if isinstance(e, OSError) and not switched else None
        if not switched:
            _remove(staging)
        if isinstance(e, OSError) and not isinstance(e, SaveError):
            raise failed(e, target, needed, file) from e
        raise
    _after_switch(target, old)


def resolved_target(target: str | Path) -> Path:
    """``target`` as an absolute path, a link to a directory followed (the directory it names is replaced).

    Raises:
        ValueError: ``target`` is a file, or a link to anything but a directory.
    """
    target = Path(os.path.abspath(Path(target).expanduser()))
    if os.path.lexists(target) and not target.is_dir():
        what = f"a link to {os.readlink(target)!r}" if target.is_symlink() else "a file"
        raise ValueError(f"{str(target)!r} is {what}, not a directory: a checkpoint save writes a directory (as "
                         "save_pretrained does). Pass a directory to write into.")
    return Path(os.path.realpath(target)) if target.is_symlink() else target


def check_switchable(target: Path, sizes: Sequence[int] = ()) -> int:
    """Check that a new directory can be written beside ``target`` and switched in; returns the bytes needed.

    Raises:
        SaveError: the parent (or its nearest existing parent) is not writable, ``target`` is a mount point,
            or the file system has fewer free bytes than ``sizes`` take (each file rounded up to whole blocks).
    """
    target = resolved_target(target)
    where = existing_parent(target.parent)
    if not os.access(where, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(where).f_flag & getattr(os, "ST_RDONLY", 1))
        raise SaveError(
            f"Cannot save into {target}: {where} is {'on a read-only file system' if read_only else 'not writable'} "
            f"for this user. A save writes a new directory beside {target.name!r} and renames it in, so "
            f"{target.parent} must be writable. Make it writable, or save elsewhere; nothing was written.",
            path=str(where), errno=errno.EROFS if read_only else errno.EACCES)
    if target.is_dir() and is_mount_point(target):  # a btrfs subvolume (its own st_dev) is none: it renames
        raise SaveError(
            f"Cannot save into {target}: it is a mount point, which cannot be renamed, and a save switches a new "
            f"directory in by renaming it. Save into a directory inside it (e.g. {target / 'model'}); nothing was "
            "written.", path=str(target), errno=errno.EBUSY)
    block = block_size(where)
    needed = sum(-(-size // block) * block for size in sizes) + block
    free = free_bytes(where)
    if free < needed:
        raise SaveError(
            f"Cannot save into {target}: the save needs {format_bytes(needed)} ({needed} bytes) on the file system "
            f"of {where}, which has {format_bytes(free)} ({free} bytes) free. Free {format_bytes(needed - free)} "
            "or save elsewhere; nothing was written.", path=str(target), needed=needed, available=free,
            errno=errno.ENOSPC)
    return needed


def failed(error: OSError, target: Path, needed: int, file: str | Path | None = None) -> SaveError:
    """The :class:`~lightning_lowmem.SaveError` of a save into ``target`` that ``error`` stopped while writing
    ``file`` (default: the file the error names, else ``target``)."""
    file = file or error.filename or target
    try:
        free: int | None = free_bytes(target.parent)
    except OSError:
        free = None
    if error.errno in _NO_SPACE:
        needs = (f"The save needs {format_bytes(needed)} ({needed} bytes) in all on that file system; " if needed
                 else "On that file system ")
        advice = (f"{needs}{'an unknown amount' if free is None else format_bytes(free)} is free now. Free some "
                  "space, or save elsewhere.")
    elif error.errno in _NO_PERMISSION:
        advice = "Make it writable for this user, or save elsewhere."
    else:
        advice = "Fix the cause and save again, or save elsewhere."
    return SaveError(f"Saving into {target} failed at {file}: {error.strerror or error}. {target} holds what it "
                     f"held before. {advice}", path=str(file), needed=needed, available=free, errno=error.errno)


def tidy(target: str | Path) -> None:
    """Clear what killed saves of ``target`` left beside it: an old directory left aside while ``target`` is
    missing is put back; every other leftover no running save holds is removed."""
    target = resolved_target(target)
    if target.parent.is_dir():
        _recover(target)
        remove_leftovers(target.parent, target.name)


def _file_in(error: OSError, staging: Path, target: Path) -> Path | None:
    """The file of ``target`` being written when ``error`` stopped the save: the one the error names, else the
    newest in ``staging`` (files are written one after another), under the name it would have had in ``target``."""
    named = Path(error.filename) if isinstance(error.filename, (str, Path)) and error.filename else None
    if named is None:
        with contextlib.suppress(OSError, ValueError):
            named = max((p for p in staging.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime_ns)
    if named is None or staging not in named.parents:
        return named
    return target / named.relative_to(staging)


def _recover(target: Path) -> None:
    """Put back the old directory that a save killed between its two renames left aside (no exchange there)."""
    if os.path.lexists(target):
        return
    pattern = leftover_pattern(target.name, old=True)
    olds = [p for p in target.parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
    if olds:
        latest = max(olds, key=lambda p: p.stat().st_ctime)
        os.rename(latest, target)
        log.warning("%s was missing: a save was interrupted while switching it; put back its old content from %s",
                    target, latest.name)


def _seal(directory: Path) -> None:
    """Every file written into ``directory`` fsynced; a link or a special file there (no save writes one) refused."""
    for entry in os.scandir(directory):
        if entry.is_dir(follow_symlinks=False):
            _seal(Path(entry.path))
            fsync_directory(Path(entry.path))
        elif entry.is_file(follow_symlinks=False):
            fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        else:
            raise SaveError(f"{entry.path} is a link or a special file, which no part of a save writes; the save "
                            "was not switched in.", path=entry.path)


def _carry(source: Path, destination: Path, drop: Callable[[os.DirEntry], bool]) -> None:
    """What ``source`` holds beyond the names in ``destination`` (and the entries ``drop`` names), carried over."""
    if not source.is_dir():
        return
    taken = set(os.listdir(destination))
    for entry in os.scandir(source):
        if entry.name in taken or entry.name.startswith(TEMPORARY_PREFIX) or drop(entry):
            continue
        _carry_entry(entry, destination / entry.name)
    step("carried")


def _carry_entry(entry: os.DirEntry, destination: Path) -> None:
    """A link as the same link, a folder as a folder of carried entries, anything else as a hard link (a copy where
    the file system makes none)."""
    if entry.is_symlink():
        os.symlink(os.readlink(entry.path), destination)  # a relative target means the same from the new place
    elif entry.is_dir(follow_symlinks=False):
        os.mkdir(destination, 0o700)
        for sub in os.scandir(entry.path):
            _carry_entry(sub, destination / sub.name)
        os.chmod(destination, stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode))
    else:
        try:
            os.link(entry.path, destination, follow_symlinks=False)
        except OSError:
            if not entry.is_file(follow_symlinks=False):
                raise
            copy_new(Path(entry.path), destination)


def _set_mode(staging: Path, target: Path) -> None:
    """The new directory gets the old one's permission bits (a new one keeps the umask's)."""
    if target.is_dir():
        os.chmod(staging, stat.S_IMODE(os.stat(target).st_mode))


def _switch(staging: Path, target: Path) -> Path | None:
    """``staging`` in as ``target``; returns where the old content is now (None when there was none)."""
    if not os.path.lexists(target):
        rename_new(staging, target)
        return None
    if exchange(staging, target):
        return staging
    old = target.parent / temporary_name(target.name, old=True)
    os.rename(target, old)
    step("moved the old directory aside")
    try:
        os.rename(staging, target)
    except OSError:
        os.rename(old, target)  # put the old one back at once rather than leave the name missing
        raise
    return old


def _after_switch(target: Path, old: Path | None) -> None:
    """Sync the switch and remove the old content; neither undoes it, so a failure here is only logged."""
    try:
        fsync_directory(target.parent)
    except OSError as e:
        log.warning("Saved into %s, but syncing %s failed (%s): a power loss now could undo the save.", target,
                    target.parent, e)
    step("switched")
    if old is not None:
        _remove(old)
        step("removed the old content")


def _remove(path: Path) -> None:
    try:
        shutil.rmtree(path)
    except OSError as e:
        log.warning("Could not remove %s (%s); the next save into the same directory removes it.", path, e)
