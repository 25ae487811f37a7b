"""How fast a checkpoint's files are read from their storage: what a model whose layers stay on disk reads at.

::

    measure_read_speed(paths)   chunks spread over the files, read with O_DIRECT: the storage itself, not the
                                page cache (a file system that refuses O_DIRECT is read plainly; tmpfs is memory)

A forward of a model with layers on disk reads them all (``disk_offload``); bytes per token over this speed is
what each token costs wherever reading is slower than computing. A file the page cache holds whole reads faster
than this (the speed of memory): the figure is the one for a model larger than the free memory.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_lowmem.system import read_at

CHUNK = 16 * 2**20
"""Bytes of each read: as large as a layer's tensors, so the figure is a streaming speed, not a seek rate."""


@dataclass(frozen=True)
class ReadSpeed:
    """A measured read speed.

    Attributes:
        bytes_per_second: bytes read over the seconds it took.
        nbytes: bytes read.
        seconds: time it took.
        direct: read with O_DIRECT (the storage); False: through the page cache (it may hold the file).
    """

    bytes_per_second: float
    nbytes: int
    seconds: float
    direct: bool

    def __str__(self) -> str:
        how = "O_DIRECT: the storage, not the page cache" if self.direct else "buffered: the page cache may hold it"
        return f"{self.bytes_per_second / 2**20:.0f} MiB/s ({self.nbytes / 2**20:.0f} MiB read, {how})"


def measure_read_speed(paths: Sequence[str | Path], nbytes: int = 256 * 2**20, direct: bool = True) -> ReadSpeed:
    """Read about ``nbytes`` from ``paths`` in chunks spread evenly over their length, and time it.

    Example::

        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "weights.bin"
        >>> _ = path.write_bytes(bytes(4 * 2**20))
        >>> speed = measure_read_speed([path], nbytes=2**20)
        >>> speed.nbytes, speed.bytes_per_second > 0
        (1048576, True)

    Raises:
        ValueError: ``paths`` hold no bytes to read.
    """
    sizes = {Path(p): os.path.getsize(p) for p in paths}
    total = sum(sizes.values())
    if total == 0:
        raise ValueError(f"Cannot measure a read speed: {', '.join(map(str, sizes)) or 'no file'} holds no bytes.")
    spans = _spans(sizes, min(nbytes, total))
    buffer = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT asks
    try:
        done, start, all_direct = 0, time.perf_counter(), direct
        for path, spans_of_file in spans.items():
            n, was_direct = _read_spans(path, spans_of_file, buffer, direct)
            done, all_direct = done + n, all_direct and was_direct
        seconds = max(time.perf_counter() - start, 1e-9)
    finally:
        buffer.close()
    return ReadSpeed(done / seconds, done, seconds, all_direct)


def _spans(sizes: dict[Path, int], nbytes: int) -> dict[Path, list[tuple[int, int]]]:
    """``(offset, length)`` chunks, page-aligned, spread over every file in proportion to its size."""
    total, page = sum(sizes.values()), mmap.PAGESIZE
    out: dict[Path, list[tuple[int, int]]] = {}
    for path, size in sizes.items():
        want = nbytes * size // total
        count = max(1, -(-want // CHUNK)) if want else 0
        step = size // max(count, 1)
        out[path] = [(i * step // page * page, min(CHUNK, want - i * CHUNK, size - i * step // page * page))
                     for i in range(count)]
    return out


def _read_spans(path: Path, spans: list[tuple[int, int]], buffer: mmap.mmap, direct: bool) -> tuple[int, bool]:
    """Bytes read from ``path`` at ``spans`` into ``buffer``, and whether with O_DIRECT: when asked and the file
    system takes it (lengths rounded up to a page then), else plainly."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return _read_with(os.O_RDONLY | os.O_DIRECT, path, spans, buffer), True
        except OSError:  # some file systems refuse O_DIRECT
            pass
    return _read_with(os.O_RDONLY, path, spans, buffer), False


def _read_with(flags: int, path: Path, spans: list[tuple[int, int]], buffer: mmap.mmap) -> int:
    fd = os.open(path, flags)
    try:
        done = 0
        for offset, length in spans:
            with memoryview(buffer) as whole, whole[:-(-length // mmap.PAGESIZE) * mmap.PAGESIZE] as view:
                done += max(0, min(read_at(fd, view, offset), length))
        return done
    finally:
        os.close(fd)
