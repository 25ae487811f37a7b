"""A tensor read a block of rows at a time: rewritten by the load's transform on its own rows, cast, and stored.

A float32 tensor loaded in bf16 and read whole is held as read beside its cast copy, three times its bf16 bytes (pi0's
257,152-row embedding set the peak of such a load); read here a block of rows at a time, one block is in float32.

A tensor stored block-quantized (a GGUF ``Q4_0`` weight) is dequantized as it is read, to float32:
read whole, it is twice its bf16 size before the cast (GGUF's token embedding of a 128k
vocabulary at 4096 dims: 2 GiB, for a 1 GiB bf16 tensor). Read here a block of rows at a time
(about :data:`~lightning_lowmem.quantize.rows.CHUNK_ELEMENTS` elements), each block is dequantized
into one reused buffer, rewritten by the transform (when it applies to blocks of rows: a
:class:`~lightning_lowmem.plan.RowTransform`, e.g. Llama's q and k un-permuted a head at a time),
and cast into the final tensor, which is the only full-size allocation; the heap the blocks freed is
handed back to the OS as the load goes (as after each quantized weight, ``memory/heap.py``).

The quantized path reads the same blocks (:func:`rows_reader`), handed to the quantizer as a
:class:`~lightning_lowmem.quantize.rows.RowSource`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch

from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.memory.heap import release_free_heap
from lightning_lowmem.plan import Target
from lightning_lowmem.plan.conversions import Transform
from lightning_lowmem.plan.transform import row_block
from lightning_lowmem.quantize.quantizer import TRIM_AT
from lightning_lowmem.quantize.rows import CHUNK_ELEMENTS, rows_per_chunk

CAST_PIECE = 1 << 14
"""Elements cast at once on the CPU: fewer than torch's parallel grain (32768), so each cast runs on the calling
thread and never waits in a parallel region for a descheduled thread. Measured on 2 cores shared with other work
(load average 10): casting 34 M float32 elements into bf16 took 0.84 s in pieces of 512k elements, 1.5 s in
pieces of 64k, 0.12 s in pieces of 16k."""
SETTLE_AT = 4 * 2**20
"""Free heap bytes a load by rows hands back (see :meth:`RowBuffer.settle`)."""


def reads_by_rows(target: Target, transform: Transform | None, reads_rows: bool) -> bool:
    """Whether ``target``'s tensor may be read a block of rows at a time: the file reads its rows on their own
    (``reads_rows``), nothing combines it, and the transform, if any, takes blocks of its rows."""
    return reads_rows and not target.parts and row_block(transform, target.names[0]) is not None


def built_by_rows(target: Target, transform: Transform | None, reads_rows: bool) -> bool:
    """Whether ``target`` is built a block of rows at a time (:func:`read_built`): 2-d or more, kept unquantized and
    whole on this rank, and either stored block-quantized and cast, moved or rewritten on its way (read as it is
    kept, a whole read is already dequantized straight into the final tensor), or stored plain, cast on its way
    and larger than one block (a float32 embedding loaded in bf16: whole, it would be read beside its cast copy)."""
    rec = target.record
    if len(rec.shape) < 2 or target.scheme is not None or target.shard is not None or target.stored is not None:
        return False
    if rec.encoding is None:
        changed = target.dtype != rec.dtype and rec.numel > CHUNK_ELEMENTS
    else:
        changed = target.dtype != rec.dtype or target.device.type != "cpu" or bool(row_block(transform, target.names[0]))
    return changed and reads_by_rows(target, transform, reads_rows)


def block_rows(target: Target, transform: Transform | None) -> int:
    """Rows per block of :func:`read_built`: about ``CHUNK_ELEMENTS`` elements, whole blocks of the transform's."""
    rec = target.record
    together = row_block(transform, target.names[0]) or 1
    return rows_per_chunk(rec.shape, align=together * math.prod(rec.shape[1:]))


class RowBuffer:
    """The buffer the blocks of rows of a load are read into, grown to the largest block, one per thread that reads
    blocks (the load's own thread; with row workers, ``quantize/workers.py``, one each: a thread uses its block before
    it reads the next), and the count of what was read through it since the heap was last handed back.

    Allocated once per load (and thread), not once per tensor: a buffer allocated and freed beside each final
    tensor left holes in the heap (SmolLM2-135M from Q4_1: +57 MiB resident after the load). gguf's
    dequantizer leaves some too (its temporaries, freed between the final tensors): :meth:`settle`
    hands the free heap back once every :data:`~lightning_lowmem.quantize.quantizer.TRIM_AT` bytes read
    (a bf16 load of SmolLM2-135M kept 31 MiB of free heap without it). A worker's buffer goes with its thread.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self.unsettled = 0  # added to from several threads: a count lost to a race only delays a trim

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` over the start of this thread's buffer (its previous contents are
        dead)."""
        nbytes = math.prod(shape) * dtype.itemsize
        held = getattr(self._local, "bytes", None)
        if held is None or held.numel() < nbytes:
            self._local.bytes = held = None  # the old one freed first
            self._local.bytes = held = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        self.unsettled += nbytes
        return held[:nbytes].view(dtype).view(shape)

    def settle(self) -> None:
        """The free heap back to the OS (``memory/heap.py``) once :data:`TRIM_AT` bytes were read since the last
        time, when it holds at least :data:`SETTLE_AT`."""
        if self.unsettled >= TRIM_AT:
            release_free_heap(SETTLE_AT)
            self.unsettled = 0


def rows_reader(ckpt: Checkpoint, target: Target, transform: Transform | None,
                buffer: RowBuffer | None = None) -> Callable[[int, int], torch.Tensor]:
    """``rows(start, stop)``: rows ``start:stop`` of ``target``'s tensor as read (record dtype) and rewritten by
    ``transform`` where it applies; a block shares memory with the previous one (``buffer``, or one of its own).

    The rows read are widened to whole blocks of the rows the transform needs together, then cut back.
    """
    rec, name = target.record, target.names[0]
    together = row_block(transform, name) or 0
    buffer = buffer if buffer is not None else RowBuffer()

    def rows(start: int, stop: int) -> torch.Tensor:
        first = start - start % together if together else start
        last = min(-(-stop // together) * together, rec.shape[0]) if together else stop
        if first == 0 and last == rec.shape[0]:  # the whole tensor: its own memory, nothing shared
            block = ckpt.read(rec.key)
        else:
            out = buffer.view((last - first, *rec.shape[1:]), rec.dtype)
            block = ckpt.read_rows(rec.key, first, last, out=out)
        if together:
            block = transform(name, block)[start - first:stop - first]
        return block

    return rows


def read_built(ckpt: Checkpoint, target: Target, transform: Transform | None,
               buffer: RowBuffer | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``target``'s final tensor (its dtype, on its device), filled a block of rows at a time: each block read
    (into ``buffer``), rewritten by ``transform`` and cast into place (into ``out`` when given: a tensor of its
    shape and dtype, such as the disk tier's slot for it)."""
    rec = target.record
    if out is None:
        out = torch.empty(rec.shape, dtype=target.dtype, device=target.device)
    buffer = buffer if buffer is not None else RowBuffer()
    rows = rows_reader(ckpt, target, transform, buffer)
    step = block_rows(target, transform)
    for start in range(0, rec.shape[0], step):
        stop = min(start + step, rec.shape[0])
        _cast_into(out[start:stop], rows(start, stop))
    buffer.settle()
    return out


def _cast_into(out: torch.Tensor, block: torch.Tensor) -> None:
    """``out`` (contiguous) = ``block`` cast to its dtype, in pieces of :data:`CAST_PIECE` elements on the CPU."""
    if out.device.type != "cpu":
        out.copy_(block)
        return
    flat_out, flat_in = out.view(-1), block.reshape(-1)
    for start in range(0, flat_out.numel(), CAST_PIECE):
        flat_out[start:start + CAST_PIECE].copy_(flat_in[start:start + CAST_PIECE])
