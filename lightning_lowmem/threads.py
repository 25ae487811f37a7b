"""Torch's intra-op thread count: the one policy every thread of this library follows.

torch's thread count is two settings (ATen's ``ParallelOpenMP.cpp``, torch 2.13):

* each thread's own count (OpenMP's ``omp_set_num_threads`` is per thread), which its kernels run on, and
* one process-wide number, which a thread copies as its own at its first parallel op (so a thread started later
  gets it).

``torch.set_num_threads(n)`` writes both. The library changes a count only for a thread of its own or for the
length of a forward of its own, and never leaves the process-wide number changed:

* :func:`own_threads` sets the calling thread's count and puts the process-wide number back at once, from a thread
  started for that (whose own count does not matter).
* :func:`keeping_process_threads` is that around a block in which threads of the library set their own counts
  (``quantize/workers.py``: each worker sets its count as it starts).

Both hold one lock while the process-wide number differs from what it was, so two of the library's threads never
read each other's value as the one to put back (two loads quantizing at once). Between ``torch.set_num_threads``
and the put-back (a thread start, tens to hundreds of microseconds) a thread of the caller's that makes its first
parallel op would copy the changed number: the one window left, the shortest torch's own API allows.

Example::

    >>> before = torch.get_num_threads()
    >>> lowered = own_threads(1)
    >>> torch.get_num_threads(), process_threads() == before
    (1, True)
    >>> lowered.restore()
    >>> torch.get_num_threads() == before
    True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

R = TypeVar("R")

_LOCK = threading.Lock()


def process_threads() -> int:
    """The count a thread starting now gets: torch's process-wide number (read from a fresh thread)."""
    return in_new_thread(torch.get_num_threads)


@contextlib.contextmanager
def keeping_process_threads() -> Iterator[None]:
    """Threads of this library may set their own counts inside the block; the process-wide number is put back as it
    was at its end (whatever ends it), and no other thread of the library changes it meanwhile."""
    with _LOCK:
        before = process_threads()
        try:
            yield
        finally:
            in_new_thread(lambda: torch.set_num_threads(before))


@dataclass
class OwnThreads:
    """A calling thread's count as it was before :func:`own_threads`; :meth:`restore` puts it back."""

    thread: int  # the thread's own count before
    ident: int  # the thread it belongs to

    def restore(self) -> None:
        """The thread's own count back (call it from that thread); the process-wide number stays as it is."""
        if threading.get_ident() != self.ident:
            raise RuntimeError("OwnThreads.restore() must run on the thread whose count own_threads() changed.")
        if torch.get_num_threads() != self.thread:
            own_threads(self.thread)


def own_threads(count: int) -> OwnThreads:
    """Set the calling thread's intra-op thread count to ``count``, leaving torch's process-wide number as it was.

    Returns:
        What to call ``restore()`` on (from this thread) to put the count back.
    """
    if count < 1:
        raise ValueError(f"own_threads needs a count >= 1, got {count}.")
    previous = OwnThreads(torch.get_num_threads(), threading.get_ident())
    with _LOCK:
        before = process_threads()
        try:
            torch.set_num_threads(count)
        finally:
            if count != before:
                in_new_thread(lambda: torch.set_num_threads(before))
    return previous


def in_new_thread(fn: Callable[[], R]) -> R:
    """``fn()`` run on a fresh thread (whose own thread settings do not matter); its result returned, its error
    raised here."""
    out: list[R] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # raised on the caller's thread
            error.append(e)

    thread = threading.Thread(target=run, name="lowmem-threads")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return out[0]
