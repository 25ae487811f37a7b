"""Copy engines: how host memory reaches a device, asynchronously and in the order issued. One convention for the
load's device path (``routes/staging.py``) and the runtime's layers off the device (``runtime/streamer.py``):

::

    CopyEngine       what the ring (``ring.py``), the staged reads and the layer streamer work over
        .pool                  the host memory copies are made from (``pinned.py``: pinned for CUDA)
        .host_buffer(n)        a block of n bytes from the pool
        .empty(shape, dtype)   memory on the device for a tensor the copies fill, allocated where the copy runs
        .copy(dst, src)        dst <- src, asynchronous; returns a Fence marking its end
        .hand_over(ts, fence)  the calling thread's work on ts starts after the fence (the consumer side)
        .synchronize()         every copy issued so far is done
    CudaCopies       a CUDA device: copies on a side stream of their own (``torch.cuda.Stream``), into memory allocated
                     for that stream; a fence is a ``torch.cuda.Event`` that blocks the host thread waiting on it (no
                     core spinning); the consumer's stream waits for it on the device (``wait_event``), and
                     ``record_stream`` tells the allocator that the consumer uses the tensors: no host wait on either
                     side, and nothing the copies issue waits for the consumer's queued work
    ThreadCopies     the CPU: one thread runs the copies in the order issued, fences are ``threading.Event`` s. The
                     ring's and the streamer's logic (buffer reuse, order, errors, clean-up) runs on a machine without a
                     GPU through it, for real; only which memory and which queue differ
    InlineCopies     the CPU where nothing is asynchronous: each copy made at once (layers offloaded to the CPU itself)

:data:`ENGINES` ties a device type to its engine; :func:`engine_for` makes one (None: the device has no device path,
and the load reads as it always did).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable

import torch

from lightning_lowmem.transfer.pinned import HostPool


class Fence:
    """The end of one copy: :meth:`wait` blocks the calling thread until it is done; :attr:`error` is what it raised."""

    error: BaseException | None = None

    def wait(self) -> None:
        raise NotImplementedError


class CopyEngine:
    """Copies from host memory to one device, asynchronous, run in the order they are issued.

    Attributes:
        device: the device copied to.
        pool: the host memory its buffers come from (pinned for CUDA), given back at :meth:`close`.
    """

    device: torch.device
    pool: HostPool

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes`` (uint8) that copies can be made from while the caller reads the next one: a
        block of :attr:`pool` (whole pages, pinned for CUDA).

        Raises:
            RuntimeError: the memory cannot be had.
        """
        return self.pool.block(nbytes)[:nbytes]

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Memory on the device for a tensor that copies will fill (uninitialised)."""
        raise NotImplementedError

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Fence:
        """Start copying ``src`` (a host buffer's view) into ``dst`` (a device tensor of its shape; a dtype that
        differs is converted on the device); ``src`` must not be written before the returned fence is done."""
        raise NotImplementedError

    def hand_over(self, tensors: Iterable[torch.Tensor], fence: Fence | None) -> None:
        """Let the calling thread's work on ``tensors`` start only after ``fence`` (the last copy into them).

        Raises:
            BaseException: the error a copy into them raised.
        """
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block until every copy issued so far is done."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the engine, after :meth:`synchronize`, and give its pool's memory back; what it handed out may be
        freed after this."""
        self.synchronize()
        self.pool.close()


# ---------------------------------------------------------------- CUDA

class _EventFence(Fence):
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()  # a blocking event: the thread sleeps until the copy is done


class CudaCopies(CopyEngine):
    """A CUDA device: pinned host blocks, copies on a side stream of their own.

    The one stream convention: a destination is allocated for the side stream (``empty``, on the thread that issues
    its copy), so the caching allocator hands it out only once the side stream may write it, and the copy never
    waits for the consumer's queued work (quantization kernels, a forward); :meth:`hand_over` makes the consumer's
    current stream wait for the copy's event on the device and records the tensors on that stream
    (``record_stream``), so that freeing them there does not let the side stream reuse them early. Events are made
    with ``blocking=True``: a thread waiting for one (a ring buffer's reuse, :meth:`synchronize`) sleeps instead of
    spinning a core.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = HostPool(device, pin=True)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with torch.cuda.stream(self.stream):
            return torch.empty(shape, dtype=dtype, device=self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Fence:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event(blocking=True)
            event.record(self.stream)
        return _EventFence(event)

    def hand_over(self, tensors: Iterable[torch.Tensor], fence: Fence | None) -> None:
        consumer = torch.cuda.current_stream(self.device)
        if isinstance(fence, _EventFence):
            consumer.wait_event(fence.event)
        for tensor in tensors:
            if tensor.device.type == "cuda":
                tensor.record_stream(consumer)

    def synchronize(self) -> None:
        event = torch.cuda.Event(blocking=True)
        event.record(self.stream)
        event.synchronize()


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
        self.pool = HostPool(self.device, pin=False)
        self._queue: queue.SimpleQueue[tuple[torch.Tensor | None, torch.Tensor | None, _ThreadFence] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None  # the first copy that failed
        self._thread = threading.Thread(target=self._serve, name="lowmem-copies", daemon=True)
        self._thread.start()

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

    def hand_over(self, tensors: Iterable[torch.Tensor], fence: Fence | None) -> None:
        if fence is not None:
            fence.wait()  # the last copy into them, after every earlier one (they run in order)
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
        self.pool.close()


class InlineCopies(CopyEngine):
    """The CPU where nothing is asynchronous: each copy made at once, in the calling thread (layers offloaded to the
    CPU that computes them: the masters copied for each forward, as onto a device)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.pool = HostPool(self.device, pin=False)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Fence | None:
        dst.copy_(src)
        return None

    def hand_over(self, tensors: Iterable[torch.Tensor], fence: Fence | None) -> None:
        return None

    def synchronize(self) -> None:
        return None


ENGINES: dict[str, Callable[[torch.device], CopyEngine]] = {"cuda": CudaCopies}
"""Device type -> the engine its loads copy through. A device type not here has no device path: its tensors are
read as they always were. (The tests put ``"cpu": ThreadCopies`` here to run the device path without a GPU.)"""


def engine_for(device: torch.device) -> CopyEngine | None:
    """The copy engine of ``device``'s type (:data:`ENGINES`), or None."""
    make = ENGINES.get(device.type)
    return make(device) if make is not None else None


def runtime_engine(device: torch.device) -> CopyEngine:
    """The engine the runtime copies layers to ``device`` through: its device type's (:data:`ENGINES`), else copies
    made at once (:class:`InlineCopies`)."""
    return engine_for(device) or InlineCopies(device)
