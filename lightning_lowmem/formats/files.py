"""One checkpoint file: a regular file only, read with ``preadv``, and watched for changes.

Every reader (``safetensors_file.py``, ``torch_zip.py``, ``gguf_file.py``) is an :class:`OpenedFile`: the
file is opened (a FIFO or a device is refused before anything waits on it) and its identity noted:
device, inode, size and modification time. Reads check the descriptor's size and modification time
again (``fstat``: every read of 1 MiB or more, smaller ones at least every 50 ms), and a load checks
every file once more after its last read, then also whether the path still names that file (a
download tool renames a new file over it; the descriptor still reads the old one whole). A file
rewritten or replaced during a load is therefore an error, and the module is put back as it was:
never a mix of old and new bytes. The path itself is looked up (``stat``) once per file when it is
opened and once when the load ends, not per read: on a shared filesystem a lookup per tensor per rank
is thousands of requests to its metadata server.

A checkpoint of many files (an index of 10,000 shards) holds only a few descriptors at a time: a file
may be :meth:`~OpenedFile.release` d and is reopened when next read, the reopened file checked to be the
same one (same identity), so any number of shards loads under the default limit of 1024 descriptors.

Ranks of a sharded load tell their files apart by content, not by modification time (each node's copy of a
checkpoint has its own): :meth:`~OpenedFile.fingerprint` is the file's size, a digest of its headers (for a
torch zip file, its central directory, which holds every record's CRC-32, checked against the bytes read)
and, where the format has no checksum (safetensors, GGUF), a digest of blocks of its data spread evenly over it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import math
import mmap
import os
import stat
import threading
import time
from pathlib import Path
from collections.abc import Callable
from typing import NamedTuple

import torch

from lightning_lowmem.errors import CheckpointError, CheckpointFormatError, CheckpointNotFoundError, CheckpointReadError
from lightning_lowmem.system import advise, read_at, read_cached

CHECK_SECONDS = 0.05
"""How often, at least, small reads check that the file did not change (two system calls: 100,000 scalar
tensors read one by one spent a fifth of their time checking)."""
CHECK_BYTES = 2**20
"""Reads of this many bytes or more always check it first."""
ADVISE_BYTES = 64 * 2**20
"""Bytes past each read that the kernel is asked to start reading now (``posix_fadvise(WILLNEED)``), so that a file
not in the page cache keeps the disk busy while the bytes read are cast, copied or quantized: see
:meth:`OpenedFile.read_into`."""


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (symlinks to one are followed).

    Opened non-blocking, so that a FIFO cannot make the open wait for a writer; the flag is
    cleared once the file is known to be regular.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        CheckpointFormatError: ``path`` is a FIFO, a device, a socket or a directory.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"Checkpoint file {str(path)!r} does not exist. Check the path.") from e
    except IsADirectoryError as e:
        raise CheckpointFormatError(f"{path} is a directory where a checkpoint file was expected.") from e
    except OSError as e:
        if e.errno not in (errno.EMFILE, errno.ENFILE):
            raise read_error(path, "open", e) from e
        raise CheckpointError(f"Cannot open {path}: this process has too many files open ({e.strerror}). Close "
                              "some, or raise the limit (ulimit -n).") from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointFormatError(
                f"{path} is not a regular file (it is a {_kind(mode)}); a checkpoint is read from a file on disk. "
                "Copy the data into a file and pass that.")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_in_order(fd: int) -> None:
    """Tell the kernel the file is read mostly in order (``POSIX_FADV_SEQUENTIAL``: its read-ahead window doubles)."""
    advise(fd, 0, 0, "SEQUENTIAL")


def read_error(path: Path, action: str, error: OSError) -> CheckpointReadError:
    """A system error opening or reading ``path`` as one of ours, with its ``errno`` and what to do."""
    return CheckpointReadError(
        error.errno, f"Cannot {action} checkpoint file {str(path)!r}: {error.strerror or error}. Check that this "
        "process may read it and that the disk or network filesystem holding it works, then load it again.")


def _kind(mode: int) -> str:
    kinds = [(stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
             (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory")]
    return next((name for test, name in kinds if test(mode)), "special file")


_NUMPY_DTYPES = frozenset((torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
                           torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128))
"""Dtypes numpy has: a tensor of one is seen as bytes in one step (the other way costs 2 us, per tensor)."""


def read_exactly(fd: int, out: torch.Tensor, offset: int, path: Path,
                 cold: Callable[[], None] | None = None) -> None:
    """Fill the contiguous CPU tensor ``out`` with the bytes of ``fd`` starting at ``offset`` (``preadv``, no copy
    between; where there is none, ``pread`` and a copy: ``system.read_at``). What the page cache holds is read
    first without waiting for the disk (``RWF_NOWAIT``); when that is not all of it, ``cold()`` is called before the
    rest is read (the reader asks the kernel to read ahead)."""
    if out.dtype in _NUMPY_DTYPES:
        buffer = memoryview(out.numpy()).cast("B")
    else:  # bfloat16, float8: numpy has no such dtype; seen as uint8 first
        buffer = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    done = read_cached(fd, buffer, offset)
    if done < len(buffer) and cold is not None:
        cold()
    while done < len(buffer):
        try:
            n = read_at(fd, buffer[done:], offset + done)
        except OSError as e:
            raise read_error(path, f"read {len(buffer) - done} bytes at offset {offset + done} of", e) from e
        if n == 0:
            raise CheckpointFormatError(
                f"{path} ends at byte {offset + done}, but a tensor needs {len(buffer) - done} more bytes there. "
                "The file is truncated: download or save it again."
            )
        done += n


SAMPLE_BYTES = 4096
"""Bytes of each block of data a fingerprint digests."""


class Fingerprint(NamedTuple):
    """What a file holds, told apart by its bytes: its size, a digest of its headers, and a digest of ``blocks``
    blocks of :data:`SAMPLE_BYTES` spread evenly over its data (0 where the headers hold the data's checksums)."""

    size: int
    headers: str
    sample: str
    blocks: int


def sample_offsets(start: int, stop: int, blocks: int) -> list[int]:
    """Where ``blocks`` blocks of :data:`SAMPLE_BYTES` start, spread evenly over bytes ``start:stop`` (the first
    block at ``start``, the last ending at ``stop``), or every block of a span that holds no more.

    Example::

        >>> sample_offsets(100, 100 + 10 * 4096, 3)
        [100, 18532, 36964]
    """
    whole = -(-(stop - start) // SAMPLE_BYTES)
    if blocks <= 0:
        return []
    if whole <= blocks:
        return [start + i * SAMPLE_BYTES for i in range(whole)]
    last = stop - SAMPLE_BYTES
    return [start + (last - start) * i // (blocks - 1) for i in range(blocks)] if blocks > 1 else [start]


class _Identity(NamedTuple):
    """What tells a file apart (a whole ``stat_result`` costs ~600 bytes: 10,000 shards, 6 MB)."""

    st_dev: int
    st_ino: int
    st_size: int
    st_mtime_ns: int


def _identity(st: os.stat_result | _Identity) -> _Identity:
    return _Identity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class OpenedFile:
    """A checkpoint file read through one descriptor at a time, with what it was when opened.

    Args:
        path: the file.
        fd: a descriptor from :func:`open_regular`; the object owns it from here (:meth:`close`).
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._descriptor: int | None = fd
        self._stat = _identity(os.fstat(fd))
        self._mapped: torch.Tensor | None = None
        self._checked_at = time.monotonic()  # when the file was last checked
        self._lock = threading.Lock()  # reopening is one thread's job
        self._advised = 0  # the end of the bytes the kernel was last asked to read ahead
        _read_in_order(fd)

    def __getstate__(self) -> dict:
        """What another rank needs to read this file without parsing its headers again: everything but the
        descriptor (:meth:`attach` opens its own)."""
        state = dict(self.__dict__)
        del state["_lock"]
        state.update(_descriptor=None, _mapped=None, _received=True)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def received(self) -> bool:
        """Whether this reader came from another rank (its headers parsed there) and is not attached yet."""
        return self.__dict__.get("_received", False)

    def attach(self) -> None:
        """Open this rank's own descriptor on a reader received from another rank. Whether it is the file that rank
        parsed is told by :meth:`fingerprint` (by content: each node's copy has its own modification time)."""
        fd = open_regular(self.path)
        self._descriptor, self._stat, self._received = fd, _identity(os.fstat(fd)), False
        _read_in_order(fd)

    def header_spans(self) -> list[tuple[int, int]]:
        """``(offset, length)`` of the bytes the reader parsed its headers from (each format says)."""
        return []

    def data_span(self) -> tuple[int, int] | None:
        """``(start, stop)`` of the tensors' data when the format keeps no checksum of it, else None."""
        return None

    def fingerprint(self, blocks: int) -> Fingerprint:
        """This file's :class:`Fingerprint`, its data sampled in ``blocks`` blocks (read now, through the
        descriptor)."""
        headers = hashlib.blake2b(digest_size=16)
        for offset, length in self.header_spans():
            for at in range(offset, offset + length, CHECK_BYTES):  # a large header (a zip's directory) in 1 MiB reads
                headers.update(self.pread(min(CHECK_BYTES, offset + length - at), at))
        span = self.data_span()
        offsets = sample_offsets(*span, blocks) if span is not None else []
        sample = hashlib.blake2b(digest_size=16)
        for offset in offsets:
            sample.update(self.pread(min(SAMPLE_BYTES, span[1] - offset), offset))
        return Fingerprint(self.size, headers.hexdigest(), sample.hexdigest() if offsets else "", len(offsets))

    @property
    def _fd(self) -> int:
        """The descriptor, reopened (and checked to be the same file) after :meth:`release`."""
        if self._descriptor is None:
            with self._lock:
                if self._descriptor is None:
                    self._descriptor = self._reopen()
        return self._descriptor

    def _reopen(self) -> int:
        try:
            fd = open_regular(self.path)
        except CheckpointNotFoundError as e:
            raise self._changed("was deleted or renamed") from e
        if _identity(os.fstat(fd)) != self._stat:
            os.close(fd)
            raise self._changed("was replaced by another file or changed")
        _read_in_order(fd)
        return fd

    @property
    def is_open(self) -> bool:
        """Whether a descriptor is held now."""
        return self._descriptor is not None

    def release(self) -> None:
        """Close the descriptor until the next read, which reopens the file and checks it is the same one.
        Only while nothing reads this file (the caller makes sure: ``Checkpoint``)."""
        with self._lock:
            if self._descriptor is not None:
                os.close(self._descriptor)
                self._descriptor = None

    def mapped_view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor of ``shape`` and ``dtype`` over the file's bytes from ``offset``, mapped, not read; None when
        ``offset`` is not a multiple of the dtype's size (read it instead).

        The file is mapped once, privately (copy-on-write: writing to a tensor never writes to the file),
        through this object's own descriptor. Every tensor made here keeps the whole mapping alive: its
        pages are file-backed, read from the file when first touched, so the file must not change while
        such a tensor lives.
        """
        nbytes = math.prod(shape) * dtype.itemsize
        self._check_span(offset, nbytes)
        if offset % dtype.itemsize:
            return None
        self._check_descriptor()
        if self._mapped is None:
            mapping = mmap.mmap(self._fd, self.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self._mapped = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
        return self._mapped[offset:offset + nbytes].view(dtype).view(shape)

    @property
    def size(self) -> int:
        return self._stat.st_size

    def check_unchanged(self) -> None:
        """Raise :class:`CheckpointFormatError` when the file was rewritten, resized or replaced since it was opened:
        the descriptor's size and modification time, and whether the path still names this file."""
        self._check_descriptor()
        try:
            named_stat = os.stat(self.path)
        except FileNotFoundError:
            raise self._changed("was deleted or renamed") from None
        if (named_stat.st_dev, named_stat.st_ino) != (self._stat.st_dev, self._stat.st_ino):
            raise self._changed("was replaced by another file")
        if _identity(named_stat) != self._stat:
            raise self._changed(f"changed (size {self._stat.st_size} -> {named_stat.st_size} bytes, modified again)")

    def _check_descriptor(self) -> None:
        """Raise :class:`CheckpointFormatError` when the open file's size or modification time changed (an
        ``fstat`` of the descriptor: no lookup of the path)."""
        self._checked_at = time.monotonic()
        now = os.fstat(self._descriptor) if self._descriptor is not None else None
        if now is not None and (now.st_size, now.st_mtime_ns) != (self._stat.st_size, self._stat.st_mtime_ns):
            raise self._changed(f"changed (size {self._stat.st_size} -> {now.st_size} bytes, modified again)")

    def _changed(self, what: str) -> CheckpointFormatError:
        return CheckpointFormatError(
            f"{self.path} {what} while it was being loaded; the weights read so far were put back on meta. "
            "Load it again once nothing writes to it.")

    def read_into(self, out: torch.Tensor, offset: int) -> torch.Tensor:
        """``out`` filled with the file's bytes from ``offset``, after checking the open file did not change (a read
        of 1 MiB or more; smaller ones at least every 50 ms)."""
        if out.nbytes >= CHECK_BYTES or time.monotonic() - self._checked_at >= CHECK_SECONDS:
            self._check_descriptor()
        self._check_span(offset, out.nbytes)
        if out.numel():
            try:
                read_exactly(self._fd, out, offset, self.path, lambda: self._advise_ahead(offset + out.nbytes))
            except CheckpointFormatError:
                self.check_unchanged()  # a file cut short since it was opened says so
                raise
        return out

    def _advise_ahead(self, end: int) -> None:
        """Ask the kernel to start reading the :data:`ADVISE_BYTES` after ``end`` (where this read stops), unless at
        least half of them were asked for already. Called only for a read the page cache could not serve whole
        (:func:`read_exactly`): from a cold page cache, the next tensors' bytes are then on their way while this one
        is handled (see ``docs/benchmarks.md``, "Cold page cache"); a warm load makes no such call."""
        ahead = self._advised - end
        if ADVISE_BYTES // 2 <= ahead <= ADVISE_BYTES:
            return
        start = end + ahead if 0 <= ahead < ADVISE_BYTES // 2 else end
        stop = min(self.size, end + ADVISE_BYTES)
        if stop > start:
            advise(self._fd, start, stop - start, "WILLNEED")  # a filesystem that takes none reads as before
        self._advised = stop

    def pread(self, size: int, offset: int) -> bytes:
        """``size`` bytes at ``offset`` (fewer at the end of the file)."""
        self._check_span(offset, min(size, max(0, self.size - offset)))
        try:
            return os.pread(self._fd, size, offset)
        except OSError as e:
            raise read_error(self.path, f"read {size} bytes at offset {offset} of", e) from e

    def _check_span(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise CheckpointFormatError(
                f"{self.path}: its headers point at bytes {offset}..{offset + size}, outside the file's {self.size} "
                "bytes. The file is truncated or damaged: download or save it again.")

    def close(self) -> None:
        self._mapped = None  # tensors made by mapped_view keep the mapping alive on their own
        self.release()
