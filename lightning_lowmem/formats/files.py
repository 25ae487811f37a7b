"""One checkpoint file, opened once: a regular file only, read with ``preadv``, and watched for changes.

Every reader (``safetensors.py``, ``torch_zip.py``) is an :class:`OpenedFile`: the file is
opened once (a FIFO or a device is refused before anything waits on it), its size,
modification time and inode are noted, and every read checks them again, so a file
rewritten or replaced between the plan and a read is an error, never a mix of old and
new bytes.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import stat
from pathlib import Path

import torch

from lightning_lowmem.errors import CheckpointFormatError, CheckpointNotFoundError


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


def _kind(mode: int) -> str:
    kinds = [(stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
             (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory")]
    return next((name for test, name in kinds if test(mode)), "special file")


def read_exactly(fd: int, out: torch.Tensor, offset: int, path: Path) -> None:
    """Fill the CPU tensor ``out`` with the bytes of ``fd`` starting at ``offset`` (``preadv``, no copy between)."""
    buffer = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n == 0:
            raise CheckpointFormatError(
                f"{path} ends at byte {offset + done}, but a tensor needs {len(buffer) - done} more bytes there. "
                "The file is truncated: download or save it again."
            )
        done += n


class OpenedFile:
    """A checkpoint file held open by one descriptor, with what it was when opened.

    Args:
        path: the file.
        fd: a descriptor from :func:`open_regular`; the object owns it from here (:meth:`close`).
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd
        self._stat = os.fstat(fd)
        self._mapped: torch.Tensor | None = None

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
        self.check_unchanged()
        if self._mapped is None:
            mapping = mmap.mmap(self._fd, self.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self._mapped = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
        return self._mapped[offset:offset + nbytes].view(dtype).view(shape)

    @property
    def size(self) -> int:
        return self._stat.st_size

    def check_unchanged(self) -> None:
        """Raise :class:`CheckpointFormatError` when the file was rewritten, resized or replaced since it was opened."""
        now = os.fstat(self._fd)
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            named = None
        same = (now.st_size, now.st_mtime_ns) == (self._stat.st_size, self._stat.st_mtime_ns)
        if same and named is not None and (named.st_ino, named.st_dev) == (now.st_ino, now.st_dev):
            return
        what = ("was deleted or renamed" if named is None else "was replaced by another file"
                if (named.st_ino, named.st_dev) != (now.st_ino, now.st_dev) else
                f"changed (size {self._stat.st_size} -> {now.st_size} bytes, modified again)")
        raise CheckpointFormatError(
            f"{self.path} {what} while it was being loaded; the weights read so far were put back on meta. "
            "Load it again once nothing writes to it.")

    def read_into(self, out: torch.Tensor, offset: int) -> torch.Tensor:
        """``out`` filled with the file's bytes from ``offset``, after checking the file did not change."""
        self.check_unchanged()
        self._check_span(offset, out.nbytes)
        if out.numel():
            read_exactly(self._fd, out, offset, self.path)
        return out

    def pread(self, size: int, offset: int) -> bytes:
        """``size`` bytes at ``offset`` (fewer at the end of the file)."""
        self._check_span(offset, min(size, max(0, self.size - offset)))
        return os.pread(self._fd, size, offset)

    def _check_span(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise CheckpointFormatError(
                f"{self.path}: its headers point at bytes {offset}..{offset + size}, outside the file's {self.size} "
                "bytes. The file is truncated or damaged: download or save it again.")

    def close(self) -> None:
        self._mapped = None  # tensors made by mapped_view keep the mapping alive on their own
        os.close(self._fd)
