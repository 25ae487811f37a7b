"""Threads that quantize blocks of rows side by side, each running its kernels on intra-op threads of its own.

Why not one block at a time on all of torch's threads: bitsandbytes' and torchao's CPU quantizers are chains
of small PyTorch ops, and each op on a block of rows is an OpenMP parallel region over every intra-op thread,
ending in a barrier. Quantizing pythia-1b by blocks of 512 Ki elements makes ~15,000 such regions. When
another busy process holds one of two cores, each region waits at its barrier for the thread that was
descheduled (libgomp spins meanwhile): bnb.int8 took 31.8 s with one competing process where it takes 2.4 s
alone (57% of the samples spinning in libgomp, 9% computing).

Here ``count`` threads each take whole blocks, read them and quantize them with ``threads`` intra-op threads
(one, up to :data:`ROW_WORKERS` cores): a descheduled thread delays only its own block, no thread waits at a
barrier for another, and one block is read from the file while another is quantized. Per-block results are
the same bytes whatever the thread count (the quantizers' reductions are max/min, their other ops elementwise).

Thread settings follow the library's one policy (``threads.py``): each worker sets its own count as it starts,
inside :func:`~lightning_lowmem.threads.keeping_process_threads`, which puts torch's process-wide number back
once they have started and keeps another of the library's threads (a second load quantizing at once, a forward
leaving a core to a read) from changing it meanwhile: the caller's count is never touched, and a thread that
starts later gets the count it would have got before. The workers end with the load.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TypeVar

import torch

from lightning_lowmem.threads import keeping_process_threads

R = TypeVar("R")

ROW_WORKERS = 4
"""At most this many blocks of rows are quantized at once (each holds its own temporaries: see
``QuantScheme.transient``). On a machine with more intra-op threads, each worker gets several."""


def row_workers(device: torch.device) -> int:
    """How many blocks of rows of a weight on ``device`` are read and quantized at once.

    On the CPU, one per intra-op thread of the calling thread (``torch.get_num_threads()``, which a user's
    ``torch.set_num_threads`` or ``OMP_NUM_THREADS`` sets), at most :data:`ROW_WORKERS`; elsewhere one (the
    device runs the kernels).

    Example::

        >>> row_workers(torch.device("meta"))
        1
    """
    if device.type != "cpu":
        return 1
    return max(1, min(torch.get_num_threads(), ROW_WORKERS))


class RowWorkers:
    """``count`` threads that run blocks of work, each with ``threads`` intra-op threads; a context manager.

    Example::

        >>> with RowWorkers(2) as workers:
        ...     list(workers.map(lambda i: torch.get_num_threads() * 10 + i, 3))
        [10, 11, 12]
    """

    def __init__(self, count: int, threads: int = 1) -> None:
        if count < 1 or threads < 1:
            raise ValueError(f"RowWorkers needs count >= 1 and threads >= 1, got count={count}, threads={threads}.")
        self.count, self.threads = count, threads
        self._tasks: queue.SimpleQueue[tuple[Future, Callable[[], object]] | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []

    @classmethod
    def for_cpu(cls) -> RowWorkers:
        """:func:`row_workers` threads sharing the calling thread's intra-op threads among them."""
        count = row_workers(torch.device("cpu"))
        return cls(count, max(1, torch.get_num_threads() // count))

    def __enter__(self) -> RowWorkers:
        started = threading.Barrier(self.count + 1)
        self._workers = [threading.Thread(target=self._serve, args=(started,), name=f"lowmem-rows-{i}", daemon=True)
                         for i in range(self.count)]
        with keeping_process_threads():  # each worker sets its own count; the process-wide number is put back
            for worker in self._workers:
                worker.start()
            started.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        for _ in self._workers:
            self._tasks.put(None)
        for worker in self._workers:
            worker.join()
        self._workers = []

    def _serve(self, started: threading.Barrier) -> None:
        torch.get_num_threads()  # this thread's first parallel setting copied now, so that the next line is the last
        torch.set_num_threads(self.threads)
        started.wait()
        while (task := self._tasks.get()) is not None:
            future, fn = task
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # handed to the caller, raised there
                    future.set_exception(e)

    def submit(self, fn: Callable[[], R]) -> Future[R]:
        """Run ``fn()`` on a worker; its result or exception comes back through the future."""
        if not self._workers:
            raise RuntimeError("RowWorkers.submit outside its `with` block: the workers are not running.")
        future: Future[R] = Future()
        self._tasks.put((future, fn))
        return future

    def map(self, fn: Callable[[int], R], n: int) -> Iterator[R]:
        """``fn(0), ..., fn(n - 1)``, all queued at once and run on the workers in that order; their results
        yielded in that order.

        All are queued, so that a worker never waits for a slower one's block before taking the next: only
        :attr:`count` run at once (each holds its temporaries), and the results should be small (the blocks of
        ``map_rows`` write their pieces in place and return None). When one raises (or the caller stops early),
        those not started are cancelled and those running are waited for before the error goes on: nothing
        runs on after this returns.
        """
        pending = deque(self.submit(lambda i=i: fn(i)) for i in range(n))
        try:
            while pending:
                yield pending[0].result()
                pending.popleft()
        finally:
            for future in pending:
                future.cancel()
            for future in pending:
                if not future.cancelled():
                    future.exception()  # wait for it; its error, if any, is not the one that stopped the loop

