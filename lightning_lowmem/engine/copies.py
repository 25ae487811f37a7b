"""Copy engines: how the device path's host buffers reach the device, asynchronously and in the order issued.

::

    CopyEngine       what the ring (``ring.py``) and the staged reads (``staging.py``) work over
        .host_buffer(n)        a host buffer of n bytes (pinned for CUDA; raises where it cannot be had)
        .empty(shape, dtype)   memory on the device for a tensor the copies fill
        .copy(dst, src)        dst <- src, asynchronous; returns a Fence marking its end
        .hand_over(t, fence)   the caller's work on t starts after the fence (the consumer side)
        .synchronize()         every copy issued so far is done
    CudaCopies       a CUDA device: ``pin_memory`` host buffers, ``non_blocking`` copies on a side stream
                     (``torch.cuda.Stream``), a ``torch.cuda.Event`` per copy that the consumer's stream waits on;
                     ``record_stream`` keeps the allocator from reusing a destination while a copy into it runs
    ThreadCopies     the CPU: one thread runs the copies in the order issued, fences are ``threading.Event`` s. The
                     ring's logic (buffer reuse, order, errors, clean-up) runs on a machine without a GPU through it,
                     for real; only which memory and which queue differ

:data:`ENGINES` ties a device type to its engine; :func:`engine_for` makes one (None: the device has no device path,
and the load reads as it always did).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


class Fence:
    """The end of one copy: :meth:`wait` blocks the calling thread until it is done; :attr:`error` is what it raised."""

    error: BaseException | None = None

    def wait(self) -> None:
        raise NotImplementedError


class CopyEngine:
    """Copies from host buffers to one device, asynchronous, run in the order they are issued."""

    device: torch.device

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes`` (uint8) that copies can be made from while the caller reads the next one.

        Raises:
            RuntimeError: the memory cannot be had (a CUDA engine: pinned memory refused).
        """
        raise NotImplementedError

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Memory on the device for a tensor that copies will fill (uninitialised)."""
        raise NotImplementedError

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Fence:
        """Start copying ``src`` (a host buffer's view) into ``dst`` (a device tensor of its shape; a dtype that
        differs is converted on the device); ``src`` must not be written before the returned fence is done."""
        raise NotImplementedError

    def hand_over(self, tensor: torch.Tensor, fence: Fence | None) -> None:
        """Let the calling thread's work on ``tensor`` start only after ``fence`` (the last copy into it).

        Raises:
            BaseException: the error a copy into it raised.
        """
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block until every copy issued so far is done."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the engine, after :meth:`synchronize`; what it handed out may be freed after this."""


# ---------------------------------------------------------------- CUDA

class _EventFence(Fence):
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()


class CudaCopies(CopyEngine):
    """A CUDA device: pinned host buffers, copies on a side stream of their own.

    Device memory is allocated for the stream of the thread that made the engine (the consumer: the load's
    loop), so that the caching allocator reuses it for that stream's work as usual, and the side stream first waits
    for the work already queued there (a block freed by the consumer may still be read by a kernel queued before
    its free). Each copy's destination is recorded on the side stream (``record_stream``: freed early, on an error,
    it is not reused before the copy ends), and :meth:`hand_over` makes the consumer's stream wait for the copy's
    event: no host synchronization on the consumer's side.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.consumer = torch.cuda.current_stream(device)
        self.stream = torch.cuda.Stream(device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with torch.cuda.stream(self.consumer):
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
        self.stream.wait_stream(self.consumer)
        return tensor

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Fence:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            dst.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return _EventFence(event)

    def hand_over(self, tensor: torch.Tensor, fence: Fence | None) -> None:
        if isinstance(fence, _EventFence):
            self.consumer.wait_event(fence.event)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self.synchronize()
        release_pinned_cache()


def release_pinned_cache() -> None:
    """Give the pinned host memory torch's caching host allocator keeps after its tensors are freed back to the
    system (the ring's buffers, once the load ends): nothing pinned stays behind a load. A torch without a way to
    do so keeps it for its next pinned allocation."""
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        empty = getattr(torch._C, name, None)
        if callable(empty):
            try:
                empty()
            except RuntimeError as e:  # a build whose host allocator is not CUDA's: nothing cached there
                log.debug("emptying the pinned host cache: %s", e)
            return


# ---------------------------------------------------------------- CPU

class _ThreadFence(Fence):
    def __init__(self) -> None:
        self.done = threading.Event()

    def wait(self) -> None:
        self.done.wait()


class ThreadCopies(CopyEngine):
    """The CPU as a device: one thread (``lowmem-copies``) runs the copies in the order issued, each after the one
    before, as a CUDA stream runs them; its buffers are plain host memory. A copy that fails makes every later
    :meth:`hand_over` raise its error (a CUDA error is sticky the same way).

    :meth:`run_copy` is the copy itself; a subclass may slow it down to show that nothing reads a buffer's next
    contents too early (the tests do).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._queue: queue.SimpleQueue[tuple[torch.Tensor | None, torch.Tensor | None, _ThreadFence] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None  # the first copy that failed
        self._thread = threading.Thread(target=self._serve, name="lowmem-copies", daemon=True)
        self._thread.start()

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Fence:
        if not self._thread.is_alive():
            raise RuntimeError("ThreadCopies.copy after close(): the copy thread has stopped.")
        fence = _ThreadFence()
        self._queue.put((dst, src, fence))
        return fence

    def run_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def _serve(self) -> None:
        while (task := self._queue.get()) is not None:
            dst, src, fence = task
            try:
                if dst is not None:
                    self.run_copy(dst, src)
            except BaseException as e:  # noqa: BLE001  (raised by every hand_over from now on, as CUDA's errors are)
                fence.error = e
                self._error = self._error or e
            finally:
                del task, dst, src  # nothing of a copy is held while the thread waits for the next
                fence.done.set()

    def hand_over(self, tensor: torch.Tensor, fence: Fence | None) -> None:
        if fence is not None:
            fence.wait()  # the last copy into it, after every earlier one (they run in order)
        if self._error is not None:
            raise self._error

    def synchronize(self) -> None:
        if self._thread.is_alive():
            marker = _ThreadFence()
            self._queue.put((None, None, marker))  # no copy: done when every copy before it is
            marker.wait()

    def close(self) -> None:
        self.synchronize()
        self._queue.put(None)
        self._thread.join()


ENGINES: dict[str, Callable[[torch.device], CopyEngine]] = {"cuda": CudaCopies}
"""Device type -> the engine its loads copy through. A device type not here has no device path: its tensors are
read as they always were. (The tests put ``"cpu": ThreadCopies`` here to run the device path without a GPU.)"""


def engine_for(device: torch.device) -> CopyEngine | None:
    """The copy engine of ``device``'s type (:data:`ENGINES`), or None."""
    make = ENGINES.get(device.type)
    return make(device) if make is not None else None
