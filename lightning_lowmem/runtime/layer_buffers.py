"""The memory the disk tier reads layers into: reused host buffers, each handed out as aligned tensor views.

::

    lay_out(specs)                 where each tensor of a layer lies in a buffer (a :class:`Slot`), 64-byte aligned
    LayerBuffers(sizes, pin)       a buffer of each size, pinned for a CUDA device: two of the largest layer on
                                   disk, and one for each layer of tied modules (``file_reads.py``)
        .buffer(i)                 buffer ``i``; ``view(buffer, slot)`` is a tensor over its bytes
        .free(i)                   wait until the copies made from buffer ``i`` to the device are done
    to_device(payload, device, stream)   a layer's tensors copied to the device (CUDA only)

A layer is read into one buffer while the previous one computes from the other, so these buffers are the only
memory the layers on disk take on the host. Fresh memory for each read would cost a page fault per page on first
touch, each time (``engine/readahead.py``); reused buffers are touched once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

ALIGN = 64
"""Bytes each view starts on a multiple of (a cache line; kernels that vectorize like aligned rows)."""


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
    """Slots for tensors of ``(shape, dtype)``, one after the other, each starting on an :data:`ALIGN` boundary;
    and the bytes they span.

    Example::

        >>> slots, nbytes = lay_out([((2, 3), torch.float32), ((4,), torch.bfloat16)])
        >>> [s.offset for s in slots], nbytes
        ([0, 64], 72)
    """
    slots, end = [], 0
    for shape, dtype in specs:
        slot = Slot(-(-end // ALIGN) * ALIGN, tuple(shape), dtype)
        slots.append(slot)
        end = slot.offset + slot.nbytes
    return slots, end


def view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The tensor ``slot`` describes, over ``buffer``'s bytes (uninitialised until written)."""
    return buffer[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


class LayerBuffers:
    """A host buffer of each of ``sizes``, pinned when the layers are copied on to a CUDA device.

    Args:
        sizes: bytes of each buffer (aligned layer sizes).
        pin: pin them (page-locked memory), so that copies to the device are asynchronous.
    """

    def __init__(self, sizes: list[int], pin: bool = False) -> None:
        self.sizes = list(sizes)
        self._buffers = [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in self.sizes]
        self._copied: list[torch.cuda.Event | None] = [None] * len(self.sizes)  # copies made from each to the device

    @property
    def nbytes(self) -> int:
        """Bytes of all the buffers together."""
        return sum(self.sizes)

    def buffer(self, index: int) -> torch.Tensor:
        """Buffer ``index``; call :meth:`free` before writing into it."""
        return self._buffers[index]

    def free(self, index: int) -> None:
        """Wait until the copies last made from buffer ``index`` to the device are done (so it can be read into)."""
        event, self._copied[index] = self._copied[index], None
        if event is not None:
            event.synchronize()

    def copied(self, index: int, event: torch.cuda.Event | None) -> None:
        """Note that copies from buffer ``index`` to the device end with ``event``."""
        self._copied[index] = event


def to_device(payloads: list, device: torch.device,
              stream: torch.cuda.Stream | None) -> tuple[list, torch.cuda.Event]:
    """Each tensor of ``payloads`` (tensors, or dicts of a stored weight's parts) copied to ``device`` on ``stream``
    (None: the current stream), and the event that marks the copies done (wait for it on the stream that uses them;
    the buffer they come from is free once it has passed)."""
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    stream = stream if stream is not None else torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        moved = [{k: move(v) for k, v in p.items()} if isinstance(p, dict) else move(p) for p in payloads]
        event = torch.cuda.Event()
        event.record(stream)
    return moved, event
