"""The ring: a few host buffers that reads land in on their way to the device, each reused once its copy is done.

::

    ring = Ring(engine, count, nbytes)     count buffers of nbytes from the copy engine (pinned for CUDA)
    i = ring.acquire()                     a free buffer, its last copy done (waits for one otherwise)
    ... read into ring.buffers[i], fence = engine.copy(device_tensor, view of it)
    ring.release(i, fence)                 back in the ring; handed out again only after fence

Its size is fixed by the load's largest piece, never by the model: :data:`SLOT_BYTES` at most per buffer (a
tensor larger than that goes through in pieces), one buffer per reading thread and two more, so that a
copy can run from each of two buffers while every thread reads into another. It is the only host memory a load
onto a device adds (``staging.py``).
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from lightning_lowmem.transfer.copies import CopyEngine, Fence

SLOT_BYTES = 32 * 2**20
"""The most bytes a ring buffer holds (a tensor's piece is read into one of them): reads of 32 MiB keep a disk's
queue full and a copy's launch cost (~10 us) below 1% of its time over a 50 GB/s link. A buffer is smaller when the
load's largest piece is, and larger only when one row of a tensor is."""
SPARE_SLOTS = 2
"""Buffers beyond one per reading thread: those whose copies are still running."""


class Ring:
    """``count`` host buffers of ``nbytes`` each from ``engine``; each handed out to one thread at a time, and given
    back with the fence of the copy made from it, to be handed out again only once that copy is done.

    Raises:
        RuntimeError: the engine cannot give the buffers (host memory refused); none is kept.
    """

    def __init__(self, engine: CopyEngine, count: int, nbytes: int) -> None:
        if count < 1 or nbytes < 1:
            raise ValueError(f"A ring needs count >= 1 and nbytes >= 1, got count={count}, nbytes={nbytes}.")
        self.nbytes = nbytes
        self.buffers: list[torch.Tensor] = [engine.host_buffer(nbytes) for _ in range(count)]
        self._free: deque[tuple[int, Fence | None]] = deque((i, None) for i in range(count))
        self._changed = threading.Condition()

    @property
    def count(self) -> int:
        return len(self.buffers)

    def acquire(self) -> int:
        """The index of a buffer no copy reads from any more (the one free longest; waits while none is free)."""
        with self._changed:
            while not self._free:
                self._changed.wait()
            index, fence = self._free.popleft()
        if fence is not None:
            fence.wait()  # its copy may still be reading it: written only after that
        return index

    def release(self, index: int, fence: Fence | None) -> None:
        """Give buffer ``index`` back; ``fence``: the copy made from it (None: none, it is free at once)."""
        with self._changed:
            self._free.append((index, fence))
            self._changed.notify()

    def close(self) -> None:
        """Drop the buffers (the engine's copies from them must be done: ``engine.synchronize()`` first)."""
        self.buffers = []
        self._free.clear()
