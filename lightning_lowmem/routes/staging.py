"""The device path: tensors read through a ring of host buffers onto the device, several at once, in the load's order.

::

    with open_stager(ckpt, routes, device) as stager:   # None: no device path (no engine, or no pinned memory)
        for each target:  payload = stager.take(target)  # its reads started ahead, its copies done or queued

For each staged route (``staged.py``), a reading thread allocates its tensor on the device, then reads it a piece at
a time into a ring buffer (``ring.py``), casts a piece there when the cast makes it smaller (a float32 file into a
bf16 model: half the bytes over the bus; a cast that widens is done on the device, by the copy), and starts the
piece's copy on the copy engine (``copies.py``: a side stream for CUDA) while it reads the next. Several threads
read several tensors at once, across files; the next tensors are read while the stream installs this one.

What is held: on the host, the ring, sized by the largest piece (never by the model); on the device, the tensors
read ahead. Those that stay as read (no quantization) are the final tensors and cost nothing extra; those that are
quantized after are held within :meth:`Stager.window` bytes (the largest tensor of the load + 64 MiB), the one being
quantized included.

On an error (a read, a copy, the loop that installs), :meth:`Stager.close` cancels what has not started, waits for
what runs and for every copy issued, and drops the ring: no thread and no host buffer is left, and the module is
put back by the caller.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from lightning_lowmem.transfer.copies import CopyEngine, Fence, engine_for
from lightning_lowmem.transfer.ring import SLOT_BYTES, SPARE_SLOTS, Ring
from lightning_lowmem.formats import Checkpoint, TensorRecord

log = logging.getLogger(__name__)

ALIGN = 64
"""Bytes the cast half of a ring buffer starts on a multiple of."""
DEVICE_SLACK = 64 * 2**20
"""Device bytes, beyond the load's largest tensor, that tensors read ahead to be quantized may hold."""


def stage_workers() -> int:
    """Threads that read tensors through the ring at once: half the CPU cores, 2 to 8 (a read from the page cache is
    a memcpy that one core runs at a few GB/s; a cold read wants several requests in flight)."""
    return min(8, max(2, (os.cpu_count() or 2) // 2))


@dataclass(frozen=True)
class Fill:
    """Rows ``start:stop`` of ``record`` copied into ``into``, a device tensor of those rows' shape (its dtype may
    differ: the cast is made on the way)."""

    record: TensorRecord
    start: int
    stop: int
    into: torch.Tensor


def host_cast(stored: torch.dtype, into: torch.dtype) -> bool:
    """Whether a piece is cast on the host before its copy: when the cast makes it smaller (fewer bytes cross the
    bus); a cast that keeps or widens its size is made on the device.

    Example::

        >>> host_cast(torch.float32, torch.bfloat16), host_cast(torch.bfloat16, torch.float32)
        (True, False)
    """
    return into.itemsize < stored.itemsize


def row_nbytes(record: TensorRecord, into: torch.dtype) -> int:
    """Ring bytes one row of ``record`` needs: as read, and cast beside it when cast on the host."""
    row = math.prod(record.shape[1:])
    return row * record.dtype.itemsize + (row * into.itemsize + ALIGN if host_cast(record.dtype, into) else 0)


def ring_nbytes(specs: Sequence[tuple[TensorRecord, torch.dtype, int]]) -> int:
    """Bytes of each ring buffer for pieces of ``(record, dtype it is copied into, rows)``: the largest piece up to
    :data:`~lightning_lowmem.transfer.ring.SLOT_BYTES`, and at least one row of each."""
    rows = max((row_nbytes(rec, dtype) for rec, dtype, _ in specs), default=1)
    whole = max((row_nbytes(rec, dtype) * n for rec, dtype, n in specs), default=1)
    return max(rows, min(SLOT_BYTES, whole), 1)


class Stager:
    """Reads the staged routes of a load (``routes``, in the load's order) onto the device through a ring.

    Args:
        ckpt: the open checkpoint.
        engine: the copy engine of the device; the stager owns it from here (:meth:`close`).
        routes: the staged routes, in the order :meth:`take` will ask for their targets.
        workers: reading threads.
        window: device bytes that tensors read ahead to be quantized may hold (see the module docstring).

    Raises:
        RuntimeError: the ring's host memory cannot be had (pinned memory refused); nothing is left behind.
    """

    def __init__(self, ckpt: Checkpoint, engine: CopyEngine, routes: Sequence, workers: int, window: int) -> None:
        self.engine, self._ckpt, self._routes = engine, ckpt, list(routes)
        self.ring = Ring(engine, workers + SPARE_SLOTS, ring_nbytes([s for r in routes for s in r.specs]))
        self.window = window
        self._order = {id(route.target): i for i, route in enumerate(self._routes)}
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="lowmem-stage")
        self._ahead_at_most = 2 * workers
        self._futures: dict[int, Future] = {}
        self._next = 0  # the next route to start reading
        self._held = 0  # device bytes of tensors started and not yet installed that are quantized after
        self._installing = 0  # of those, the bytes of the one handed out last

    def take(self, target: object) -> object:
        """What ``target``'s route fills, on the device, ready for the calling thread's work (its reads started ahead;
        the next ones start now). Targets must be asked for in the order of the routes.

        Raises:
            CheckpointError: reading it failed (the file's error, as a load without the device path raises it).
        """
        index = self._order[id(target)]
        self._held -= self._installing  # the one handed out before is installed by now
        self._installing = 0
        self._start(index)
        payload, fence = self._futures.pop(index).result()
        self.engine.hand_over(payload.values() if isinstance(payload, dict) else (payload,), fence)
        self._installing = self._routes[index].held_nbytes
        self._start(index)
        return payload

    def _start(self, needed: int) -> None:
        """Start reading the routes up to ``needed``, and beyond it while the window allows."""
        while self._next < len(self._routes):
            cost = self._routes[self._next].held_nbytes
            if self._next > needed and (len(self._futures) >= self._ahead_at_most or self._held + cost > self.window):
                return
            self._futures[self._next] = self._pool.submit(self._fetch, self._routes[self._next])
            self._held += cost
            self._next += 1

    def _fetch(self, route: object) -> tuple[object, Fence | None]:
        """In a reading thread: ``route``'s tensor allocated on the device and filled; the fence of its last copy."""
        payload, fills = route.fills(self.engine)
        fence = None
        for fill in fills:
            fence = self._fill(fill) or fence
        return payload, fence

    def _fill(self, fill: Fill) -> Fence | None:
        """``fill`` read a piece at a time through the ring, each piece's copy started before the next is read."""
        rec = fill.record
        if rec.numel == 0 or fill.start == fill.stop:
            return None
        step = max(1, self.ring.nbytes // row_nbytes(rec, fill.into.dtype))
        fence = None
        for start in range(fill.start, fill.stop, step):
            stop = min(start + step, fill.stop)
            index, fence = self.ring.acquire(), None
            try:
                src = self._read(rec, start, stop, self.ring.buffers[index], fill.into.dtype)
                dst = fill.into[start - fill.start:stop - fill.start]
                fence = self.engine.copy(dst, src.view(dst.shape))
            finally:
                self.ring.release(index, fence)
        return fence

    def _read(self, rec: TensorRecord, start: int, stop: int, buffer: torch.Tensor, into: torch.dtype) -> torch.Tensor:
        """Rows ``start:stop`` of ``rec`` read into the start of ``buffer``; cast into its second part when the cast
        makes them smaller."""
        shape = (stop - start, *rec.shape[1:])
        n = math.prod(shape)
        raw = buffer[:n * rec.dtype.itemsize].view(rec.dtype).view(shape)
        if start == 0 and stop == rec.shape[0]:
            got = self._ckpt.read(rec.key, out=raw)  # whole: a torch record's CRC-32 checked at once
        else:
            got = self._ckpt.read_rows(rec.key, start, stop, out=raw)
        if got.data_ptr() != raw.data_ptr():
            raw.copy_(got)
        if not host_cast(rec.dtype, into):
            return raw
        at = -(-raw.nbytes // ALIGN) * ALIGN
        cast = buffer[at:at + n * into.itemsize].view(into).view(shape)
        cast.copy_(raw)
        return cast

    def close(self) -> None:
        """Stop: reads not started are cancelled, running ones waited for, every copy issued waited for; then the ring
        and the engine are dropped."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        try:
            self.engine.synchronize()  # every copy done, before the tensors read ahead and the ring are dropped
        finally:
            self._futures.clear()
            self.ring.close()
            self.engine.close()  # after the ring: the pool's pinned blocks are given back here


def load_window(routes: Sequence) -> int:
    """:attr:`Stager.window` for a load of ``routes`` (all of its routes): its largest tensor + 64 MiB."""
    return max((r.target.record.tensor_nbytes for r in routes), default=0) + DEVICE_SLACK


@contextmanager
def open_stager(ckpt: Checkpoint, staged: Sequence, device: torch.device | None, window: int,
                workers: int | None = None) -> Iterator[Stager | None]:
    """A :class:`Stager` for the ``staged`` routes onto ``device``, closed at the end of the block; None when there
    are none, ``device`` has no copy engine, or the ring's memory cannot be had (pinned memory refused: logged, and
    the load reads as it does without the device path)."""
    engine = engine_for(device) if staged and device is not None else None
    stager = None
    if engine is not None:
        try:
            stager = Stager(ckpt, engine, staged, workers or stage_workers(), window)
        except RuntimeError as e:
            engine.close()
            log.warning("The device path's host buffers could not be allocated (%s); loading onto %s with pageable "
                        "copies instead, as without it.", e, device)
    try:
        yield stager
    finally:
        if stager is not None:
            stager.close()
