"""The memory the disk tier reads layers into: reused host buffers, each handed out as aligned tensor views.

::

    lay_out(specs)                 where each tensor of a layer lies in a buffer (a :class:`Slot`), 64-byte aligned
                                   (``transfer/pinned.py``: the arithmetic the placement counts with)
    LayerBuffers(sizes, device)    a buffer of each size, from a host pool (pinned for a CUDA device, whole pages):
                                   two of the largest layer on disk, and one for each layer of tied modules
                                   (``file_reads.py``)
        .buffer(i)                 buffer ``i``; ``view(buffer, slot)`` is a tensor over its bytes
        .free(i)                   wait until the copies made from buffer ``i`` to the device are done
    to_device(payloads, engine)    a layer's tensors copied to the device through the streamer's copy engine

A layer is read into one buffer while the previous one computes from the other, so these buffers are the only
memory the layers on disk take on the host. Fresh memory for each read would cost a page fault per page on first
touch, each time (``routes/readahead.py``); reused buffers are touched once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from lightning_lowmem.transfer import CopyEngine, Fence, HostPool
from lightning_lowmem.transfer import lay_out as lay_out_bytes

@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in a layer buffer: its byte offset, shape and dtype."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def lay_out(specs: Iterable[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[Slot], int]:
    """Slots for tensors of ``(shape, dtype)``, one after the other, each starting on a 64-byte boundary;
    and the bytes they take (``transfer.lay_out``).

    Example::

        >>> slots, nbytes = lay_out([((2, 3), torch.float32), ((4,), torch.bfloat16)])
        >>> [s.offset for s in slots], nbytes
        ([0, 64], 128)
    """
    specs = [(tuple(shape), dtype) for shape, dtype in specs]
    offsets, nbytes = lay_out_bytes(math.prod(shape) * dtype.itemsize for shape, dtype in specs)
    return [Slot(offset, shape, dtype) for offset, (shape, dtype) in zip(offsets, specs)], nbytes


def view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The tensor ``slot`` describes, over ``buffer``'s bytes (uninitialised until written)."""
    return buffer[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


class LayerBuffers:
    """A host buffer of each of ``sizes``, from a pool of host memory (pinned when the layers are copied on to a
    CUDA device; whole pages).

    Args:
        sizes: bytes of each buffer (aligned layer sizes).
        device: the device the layers are copied to (CUDA: the buffers are pinned, so that copies are asynchronous).
    """

    def __init__(self, sizes: list[int], device: torch.device | str = "cpu") -> None:
        self.sizes = list(sizes)
        self.pool = HostPool(device)
        self._buffers = [self.pool.block(n)[:n] for n in self.sizes]
        self._copied: list[Fence | None] = [None] * len(self.sizes)  # copies made from each to the device

    @property
    def nbytes(self) -> int:
        """Bytes the buffers take together: the pool's blocks (whole pages)."""
        return self.pool.nbytes

    def buffer(self, index: int) -> torch.Tensor:
        """Buffer ``index``; call :meth:`free` before writing into it."""
        return self._buffers[index]

    def free(self, index: int) -> None:
        """Wait until the copies last made from buffer ``index`` to the device are done (so it can be read into)."""
        fence, self._copied[index] = self._copied[index], None
        if fence is not None:
            fence.wait()

    def copied(self, index: int, fence: Fence | None) -> None:
        """Note that copies from buffer ``index`` to the device end with ``fence``."""
        self._copied[index] = fence


def to_device(payloads: list, engine: CopyEngine) -> tuple[list, Fence | None]:
    """Each tensor of ``payloads`` (tensors, or dicts of a stored weight's parts) copied to ``engine``'s device, and
    the fence of the last copy (the buffer they come from is free once it has passed; the consumer hands the copies
    over with ``engine.hand_over``)."""
    fence = None

    def move(t: torch.Tensor) -> torch.Tensor:
        nonlocal fence
        out = engine.empty(tuple(t.shape), t.dtype)
        fence = engine.copy(out, t) or fence
        return out

    moved = [{k: move(v) for k, v in p.items()} if isinstance(p, dict) else move(p) for p in payloads]
    return moved, fence
