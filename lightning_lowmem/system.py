"""What the operating system offers the library, probed once: the calls it uses where they exist, and the fallbacks.

lightning_lowmem runs on Linux and macOS. Windows (no ``fcntl``, no positioned reads) is refused when the package
is imported, with an error that says so (:func:`check_supported`). Where a call is missing the fallback runs::

    call                       Linux                        macOS                         fallback
    read at an offset          os.preadv, into the tensor   os.preadv (macOS 11 and on)   os.pread, then a copy
    swap two names at once     renameat2(RENAME_EXCHANGE)   renamex_np(RENAME_SWAP)       two renames (undone after
                                                                                          a kill by the next save)
    rename, never replacing    renameat2(RENAME_NOREPLACE)  renamex_np(RENAME_EXCL)       a check, then a rename
    a file unseen until locked O_TMPFILE, then linked       -                             created, locked, checked
                                                                                          to be still its own
    is a directory a mount     /proc/self/mountinfo         st_dev differs from parent's  st_dev, as on macOS

Tests replace the probes (``_SWAP``, ``HAS_PREADV``, ``O_TMPFILE``, ``MOUNTINFO``) to run each fallback on Linux.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from lightning_lowmem.errors import UnsupportedPlatformError

HAS_PREADV = hasattr(os, "preadv")
"""Whether ``os.preadv`` exists (Linux; macOS 11 and later)."""
O_TMPFILE: int | None = getattr(os, "O_TMPFILE", None) if sys.platform.startswith("linux") else None
"""Linux's flag for an unnamed file in a directory, or None."""
MOUNTINFO = Path("/proc/self/mountinfo")
"""Linux's list of this process's mount points."""
PREAD_CHUNK = 16 * 2**20
"""Bytes one ``os.pread`` of the fallback reads at most (its copy is that much memory, briefly)."""


def check_supported() -> None:
    """Raise :class:`~lightning_lowmem.errors.UnsupportedPlatformError` where the library cannot run: Windows, or a
    system without ``fcntl`` or ``os.pread``."""
    missing = [name for name, present in (("fcntl", _has_fcntl()), ("os.pread", hasattr(os, "pread"))) if not present]
    if sys.platform.startswith(("win", "cygwin")) or missing:
        lacks = f" (it has no {' and no '.join(missing)})" if missing else ""
        raise UnsupportedPlatformError(
            f"lightning_lowmem runs on Linux and macOS; this is {sys.platform}{lacks}. Its loads read each tensor at "
            "its offset in the file (positioned reads) and its saves lock and swap files atomically (POSIX calls). "
            "On Windows, run it under WSL2 (a Linux distribution), with the checkpoint on the Linux file system.")


def _has_fcntl() -> bool:
    try:
        import fcntl  # noqa: F401
    except ImportError:
        return False
    return True


def read_at(fd: int, view: memoryview, offset: int) -> int:
    """Read into ``view`` (bytes) from ``fd`` at ``offset``, without moving the file position; the bytes read
    (0 at the end of the file). ``os.preadv`` reads straight into ``view``; without it, ``os.pread`` reads at most
    :data:`PREAD_CHUNK` bytes and they are copied."""
    if HAS_PREADV:
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, min(len(view), PREAD_CHUNK), offset)
    view[:len(data)] = data
    return len(data)


def advise(fd: int, offset: int, length: int, advice: str) -> None:
    """Give the kernel a hint about how ``fd`` is read (``posix_fadvise``: ``"SEQUENTIAL"``, ``"WILLNEED"``); nothing
    where the call or the advice does not exist (macOS) or the filesystem takes no hints."""
    call, flag = getattr(os, "posix_fadvise", None), getattr(os, f"POSIX_FADV_{advice}", None)
    if call is None or flag is None:
        return
    try:
        call(fd, offset, length, flag)
    except OSError:  # a hint only
        pass


def read_cached(fd: int, view: memoryview, offset: int) -> int:
    """Bytes of ``view`` read from the page cache alone, without waiting for the disk (``preadv2(RWF_NOWAIT)``); 0
    where nothing is cached at ``offset`` or the system cannot say (no ``RWF_NOWAIT``: macOS, older kernels)."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None or not HAS_PREADV or not len(view):
        return 0
    try:
        return os.preadv(fd, [view], offset, flag)
    except OSError:  # EAGAIN: nothing cached at offset; EOPNOTSUPP, EINVAL: no such flag here
        return 0


class Swap(NamedTuple):
    """A rename call that takes flags, and its flags: ``call(old, new, flags)`` returns 0, or -1 with ``errno`` set."""

    call: Callable[[bytes, bytes, int], int]
    exchange: int
    noreplace: int


_SWAP: list[Swap | None] = []  # probed once


def swap_call() -> Swap | None:
    """Linux's ``renameat2`` (glibc 2.28 and later) or macOS's ``renamex_np``, or None where there is neither."""
    if not _SWAP:
        _SWAP.append(_probe_swap())
    return _SWAP[0]


def _probe_swap() -> Swap | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if sys.platform == "darwin":  # <stdio.h>: RENAME_SWAP 0x2, RENAME_EXCL 0x4 (macOS 10.12 and later)
            renamex = libc.renamex_np
            renamex.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint]
            renamex.restype = ctypes.c_int
            return Swap(renamex, 0x2, 0x4)
        renameat2 = libc.renameat2
        renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        renameat2.restype = ctypes.c_int
    except (AttributeError, OSError, TypeError):
        return None
    at_cwd = -100  # AT_FDCWD
    return Swap(lambda old, new, flags: renameat2(at_cwd, old, at_cwd, new, flags), 2, 1)


def is_mount_point(path: Path) -> bool:
    """Whether the directory ``path`` is where a file system is mounted (it cannot be renamed).

    On Linux the mount table says (``/proc/self/mountinfo``): a btrfs subvolume, whose ``st_dev`` differs from its
    parent's, is no mount point, and a bind mount of a directory of the same file system is one. Elsewhere (or
    without ``/proc``) a directory whose ``st_dev`` differs from its parent's counts as one.
    """
    real = os.path.realpath(path)
    try:
        with open(MOUNTINFO, "rb") as f:
            points = {_unescape(line.split(b" ")[4]) for line in f if line.count(b" ") >= 5}
    except OSError:
        return real == os.path.dirname(real) or os.stat(real).st_dev != os.stat(os.path.dirname(real)).st_dev
    return os.fsencode(real) in points


def _unescape(field: bytes) -> bytes:
    r"""A mountinfo path: spaces, tabs, newlines and backslashes written as octal escapes (``\040``)."""
    if b"\\" not in field:
        return field
    out, i = bytearray(), 0
    while i < len(field):
        if field[i:i + 1] == b"\\" and field[i + 1:i + 4].isdigit():
            out.append(int(field[i + 1:i + 4], 8))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return bytes(out)
