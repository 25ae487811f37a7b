"""Host memory that copies to a device are made from: blocks a pool hands out, pinned (page-locked) for a CUDA device,
carved into tensors, and counted in the bytes they really take.

::

    lay_out(sizes)             where each of tensors of ``sizes`` bytes starts in a block (multiples of 64), and the
                               bytes they span together
    block_nbytes(nbytes)       the bytes a block of ``nbytes`` takes: whole pages. The placement, the estimate and the
                               pool count with these two, so their numbers are the pool's
    pool = HostPool(device)    blocks pinned when ``device`` is CUDA
        pool.block(nbytes)     a uint8 tensor of ``block_nbytes(nbytes)`` bytes, its start on a page
        pool.nbytes            the bytes of the blocks it holds
        pool.close()           its blocks unpinned and dropped (the copies made from them must be done)

Why not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator rounds every block up to a power of two
(a 1.7 GB buffer takes 2 GiB) and keeps freed blocks for the whole process, to be given back only by emptying the
cache of every user of pinned memory at once (a ``DataLoader(pin_memory=True)`` beside the model included). A pool's
block is host memory of its exact size (whole pages), pinned with ``cudaHostRegister`` as torch's own checkpoint
stager pins its buffers, and unpinned (``cudaHostUnregister``) when the pool lets it go: nothing rounded, nothing
kept, nobody else's memory touched.

Pinning that is refused (the system's page-locked memory exhausted) is logged once per process, and the block stays
pageable: copies from it are then made at the speed and with the waits of pageable memory, and the bytes are the
same. The registration runs in a thread of its own, on the pool's device: a CUDA call that fails leaves its error
in the calling thread, where torch would report it as the next kernel's.
"""

from __future__ import annotations

import logging
import mmap
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

log = logging.getLogger(__name__)

ALIGN = 64
"""Bytes each tensor carved from a block starts on a multiple of (a cache line; any dtype's alignment)."""
PAGE = mmap.PAGESIZE
"""Bytes of a page: blocks are whole pages of their own (no two pinned ranges share a page)."""
PORTABLE = 1
"""``cudaHostRegisterPortable``: pinned for every CUDA context of the process, not only the registering one's."""

_lock = threading.Lock()
_registered: dict[int, tuple[int, torch.device]] = {}  # pointer -> (bytes, device), of the blocks this library has pinned and not unpinned yet
_refused_logged = False


def lay_out(sizes: Iterable[int]) -> tuple[list[int], int]:
    """The offset of each of tensors of ``sizes`` bytes carved one after the other from a block, each starting on a
    multiple of :data:`ALIGN`; and the bytes they take together (each rounded up to :data:`ALIGN`, so the total is
    the same in any order).

    Example::

        >>> lay_out([10, 64, 1])
        ([0, 64, 128], 192)
    """
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGN) * ALIGN
    return offsets, end


def block_nbytes(nbytes: int) -> int:
    """The bytes a block of ``nbytes`` takes from a pool: whole pages.

    Example::

        >>> block_nbytes(1), block_nbytes(PAGE), block_nbytes(0)
        (4096, 4096, 0)
    """
    return -(-nbytes // PAGE) * PAGE


def registered_nbytes() -> int:
    """Bytes this library has pinned and not unpinned yet, in every pool of the process."""
    with _lock:
        return sum(nbytes for nbytes, _ in _registered.values())


class HostPool:
    """Blocks of host memory for copies to ``device``: pinned when it is a CUDA device (and ``pin`` is not False).

    Args:
        device: the device the copies go to.
        pin: pin the blocks; default: when ``device`` is CUDA and CUDA is available.
    """

    def __init__(self, device: torch.device | str, pin: bool | None = None) -> None:
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda" and torch.cuda.is_available() if pin is None else pin
        self._blocks: list[tuple[torch.Tensor, int | None]] = []  # (block, its pinned pointer or None)
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _unpin_all, self._blocks)
        self._finalizer.atexit = False  # after the CUDA context is gone, there is nothing to unpin

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks the pool holds."""
        with self._lock:
            return sum(block.numel() for block, _ in self._blocks)

    @property
    def pinned(self) -> bool:
        """Whether every block it holds is pinned (False once pinning was refused)."""
        with self._lock:
            return self.pin and all(ptr is not None for _, ptr in self._blocks)

    def block(self, nbytes: int) -> torch.Tensor:
        """A block of :func:`block_nbytes` ``(nbytes)`` bytes (uint8, zeros until written), pinned where the pool pins:
        an anonymous memory map of its own (its pages touched when written, or when pinned; given back to the system
        with the last view of it). It is the pool's until :meth:`release` or :meth:`close`."""
        size = block_nbytes(max(nbytes, 1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": an anonymous map is writable
            block = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)  # its own pages, freed with its views
        ptr = block.data_ptr() if self.pin and _pin(block.data_ptr(), size, self.device) else None
        with self._lock:
            self._blocks.append((block, ptr))
        return block

    def release(self, block: torch.Tensor) -> None:
        """Unpin ``block`` and let it go (the copies made from it must be done); views of it stay valid."""
        with self._lock:
            found = [entry for entry in self._blocks if entry[0] is block]
            self._blocks[:] = [entry for entry in self._blocks if entry[0] is not block]
        _unpin_all(found)

    def close(self) -> None:
        """Unpin and let go every block (the copies made from them must be done). Idempotent."""
        with self._lock:
            blocks, self._blocks[:] = list(self._blocks), []
        _unpin_all(blocks)


def carve(block: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` over ``block``'s bytes from ``offset`` (uninitialised until written)."""
    nbytes = dtype.itemsize
    for size in shape:
        nbytes *= size
    return block[offset:offset + nbytes].view(dtype).view(shape)


def _pin(ptr: int, nbytes: int, device: torch.device) -> bool:
    """Register ``nbytes`` at ``ptr`` as pinned memory; False (logged once) when refused."""
    code = _cuda_call(device, lambda cudart: cudart.cudaHostRegister(ptr, nbytes, PORTABLE))
    if code == 0:
        with _lock:
            _registered[ptr] = (nbytes, device)
        return True
    global _refused_logged
    if not _refused_logged:
        _refused_logged = True
        log.warning("Pinning %d bytes of host memory for copies to %s was refused (%s); those copies are made from "
                    "pageable memory instead (slower, and they wait for the host). Free page-locked memory, or "
                    "raise the limit on it, to have them pinned.", nbytes, device, code)
    return False


def _unpin_all(blocks: list[tuple[torch.Tensor, int | None]]) -> None:
    for _, ptr in blocks:
        if ptr is None:
            continue
        with _lock:
            _, device = _registered.pop(ptr, (0, torch.device("cuda")))
        code = _cuda_call(device, lambda cudart: cudart.cudaHostUnregister(ptr))
        if code != 0:
            log.debug("unpinning host memory at %#x: %s", ptr, code)


def _cuda_call(device: torch.device, call: Callable[[Any], object]) -> int | BaseException:
    """``call(cudart)`` in a thread of its own, with ``device`` current there: its error code (0: success), or what
    it raised. A CUDA runtime call that fails leaves its error in the calling thread, where torch would report it as
    the error of the next kernel launched there; this thread launches none."""
    result: list[int | BaseException] = []

    def run() -> None:
        try:
            torch.cuda.set_device(device if device.index is not None else torch.device(device.type, 0))
            result.append(int(call(torch.cuda.cudart())))
        except Exception as e:  # noqa: BLE001  (no CUDA runtime here: the caller reports it as a refusal)
            result.append(e)

    thread = threading.Thread(target=run, name="lowmem-pin")
    thread.start()
    thread.join()
    return result[0]
