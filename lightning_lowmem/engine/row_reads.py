"""A tensor read a block of rows at a time: rewritten by the load's transform on its own rows, cast, and stored.

A tensor stored block-quantized (a GGUF ``Q4_0`` weight) is dequantized as it is read, to float32:
read whole, it is twice its bf16 size before the cast (GGUF's token embedding of a 128k
vocabulary at 4096 dims: 2 GiB, for a 1 GiB bf16 tensor). Read here a block of rows at a time
(about :data:`~lightning_lowmem.quantize.rows.CHUNK_ELEMENTS` elements), each block is dequantized
into one reused buffer, rewritten by the transform (when it applies to blocks of rows: a
:class:`~lightning_lowmem.plan.RowTransform`, e.g. Llama's q and k un-permuted a head at a time),
and cast into the final tensor, which is the only full-size allocation; the heap the blocks freed
is handed back to the OS after each tensor (as after each quantized weight, ``memory/heap.py``).

The quantized path reads the same blocks (:func:`rows_reader`), handed to the quantizer as a
:class:`~lightning_lowmem.quantize.rows.RowSource`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.memory.heap import release_free_heap
from lightning_lowmem.plan import Target
from lightning_lowmem.plan.transform import row_block
from lightning_lowmem.quantize.quantizer import TRIM_AT
from lightning_lowmem.quantize.rows import rows_per_chunk

Transform = Callable[[str, torch.Tensor], torch.Tensor]


def reads_by_rows(target: Target, transform: Transform | None, reads_rows: bool) -> bool:
    """Whether ``target``'s tensor may be read a block of rows at a time: the file reads its rows on their own
    (``reads_rows``), nothing combines it, and the transform, if any, takes blocks of its rows."""
    return reads_rows and not target.parts and row_block(transform, target.names[0]) is not None


def built_by_rows(target: Target, transform: Transform | None, reads_rows: bool) -> bool:
    """Whether ``target`` is built a block of rows at a time (:func:`read_built`): stored block-quantized, 2-d or
    more, kept unquantized and whole on this rank, and cast, moved or rewritten on its way (read as it is kept, a
    whole read is already dequantized straight into the final tensor)."""
    rec = target.record
    if rec.encoding is None or len(rec.shape) < 2 or target.scheme is not None or target.shard is not None:
        return False
    changed = target.dtype != rec.dtype or target.device.type != "cpu" or bool(row_block(transform, target.names[0]))
    return changed and target.stored is None and reads_by_rows(target, transform, reads_rows)


def block_rows(target: Target, transform: Transform | None) -> int:
    """Rows per block of :func:`read_built`: about ``CHUNK_ELEMENTS`` elements, whole blocks of the transform's."""
    rec = target.record
    together = row_block(transform, target.names[0]) or 1
    return rows_per_chunk(rec.shape, align=together * math.prod(rec.shape[1:]))


def rows_reader(ckpt: Checkpoint, target: Target, transform: Transform | None) -> Callable[[int, int], torch.Tensor]:
    """``rows(start, stop)``: rows ``start:stop`` of ``target``'s tensor as read (record dtype) and rewritten by
    ``transform`` where it applies; a block may share memory with the previous one (one reused buffer).

    The rows read are widened to whole blocks of the rows the transform needs together, then cut back.
    """
    rec, name = target.record, target.names[0]
    together = row_block(transform, name) or 0
    row_elements = math.prod(rec.shape[1:])
    buffer = torch.empty(0, dtype=rec.dtype)

    def rows(start: int, stop: int) -> torch.Tensor:
        nonlocal buffer
        first = start - start % together if together else start
        last = min(-(-stop // together) * together, rec.shape[0]) if together else stop
        if first == 0 and last == rec.shape[0]:  # the whole tensor: its own memory, nothing shared
            block = ckpt.read(rec.key)
        else:
            n = (last - first) * row_elements
            if buffer.numel() < n:
                buffer = torch.empty(n, dtype=rec.dtype)
            block = ckpt.read_rows(rec.key, first, last, out=buffer[:n].view(last - first, *rec.shape[1:]))
        if together:
            block = transform(name, block)[start - first:stop - first]
        return block

    return rows


def read_built(ckpt: Checkpoint, target: Target, transform: Transform | None) -> torch.Tensor:
    """``target``'s final tensor (its dtype, on its device), filled a block of rows at a time: each block read,
    rewritten by ``transform`` and cast into place."""
    rec = target.record
    out = torch.empty(rec.shape, dtype=target.dtype, device=target.device)
    rows = rows_reader(ckpt, target, transform)
    step = block_rows(target, transform)
    for start in range(0, rec.shape[0], step):
        stop = min(start + step, rec.shape[0])
        out[start:stop].copy_(rows(start, stop))
    release_free_heap(TRIM_AT)  # the blocks' buffers and gguf's temporaries: out of RSS, not only freed
    return out
