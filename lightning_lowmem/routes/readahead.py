"""Two ways to make checkpoint reads cheaper: reading ahead, and reusing one buffer.

Reading ahead overlaps checkpoint reads with the work done on each tensor.

``pread`` releases the GIL, so a second thread can copy the next tensor out of
the page cache while the first is cast, moved, quantized or assigned. The bytes
read ahead are capped, so the transient memory stays within "one tensor plus a
small window". Only tensors read as they are kept are read ahead (in a load that quantizes, while the
weights are quantized); transient copies are not read ahead at all: freed from
another thread's malloc arena, they were measured to raise the peak by ~0.2x
the model (fp32 -> bf16), where reads that become the final tensors cost nothing.

Transient copies are read into one :class:`ScratchBuffer` instead, sized to the
largest of them: fresh memory costs a page fault per page on first touch (large
allocations are fresh ``mmap`` s each time), so reusing the same pages for every
tensor that is cast, moved or quantized right after its read saves that cost
without raising the peak (one transient tensor was already part of it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


SMALL_READ = 256 * 2**10
"""Tensors smaller than this are read in the calling thread, when their turn comes: handing a read to
another thread costs ~30 us and a future, more than reading a small tensor, and tiny tensors made in
another thread cost memory there (100,000 scalar tensors read ahead took +150 MiB and 4x the time)."""


def read_ahead(
    items: Sequence[T],
    read: Callable[[T], R],
    nbytes: Callable[[T], int],
    window: int,
    workers: int = 2,
    accept: Callable[[T], bool] = lambda item: True,
) -> Iterator[tuple[T, R]]:
    """Yield ``(item, read(item))`` in order, reading items of :data:`SMALL_READ` bytes or more that ``accept``
    accepts up to ``window`` bytes ahead in other threads.

    A large item is always read in another thread, however large; further reads start only while the
    bytes read but not yet handed out stay within ``window``. Small items, and those ``accept`` refuses, are
    read in the calling thread when their turn comes (so a buffer the calling thread reuses is never read into
    from elsewhere). With ``window=0`` everything is read in the calling thread, one item at a time.
    """
    if window <= 0:
        yield from ((item, read(item)) for item in items)
        return
    sizes = [nbytes(item) for item in items]
    futures: dict[int, Future[R]] = {}
    in_flight, ahead = 0, 0  # bytes read ahead and not handed out; the next item to consider reading ahead
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lowmem-read")
    try:
        for i, item in enumerate(items):
            ahead = max(ahead, i)
            while ahead < len(items) and (ahead == i or in_flight + sizes[ahead] <= window):
                if sizes[ahead] >= SMALL_READ and accept(items[ahead]):
                    futures[ahead] = pool.submit(read, items[ahead])
                    in_flight += sizes[ahead]
                ahead += 1
            future = futures.pop(i, None)
            if future is None:
                yield item, read(item)
            else:
                in_flight -= sizes[i]
                yield item, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class ScratchBuffer:
    """One reusable buffer that transient reads are made into, one at a time.

    Only for tensors that are copied (cast, moved, quantized) before the next read, and
    only read in the calling thread (``read_ahead`` reads ahead only the tensors that are kept as read).
    """

    def __init__(self, nbytes: int) -> None:
        self._buffer = torch.empty(nbytes, dtype=torch.uint8, device="cpu")

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` over the start of the buffer."""
        nbytes = math.prod(shape) * dtype.itemsize
        return self._buffer[:nbytes].view(dtype).view(shape)
