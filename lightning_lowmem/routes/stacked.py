"""The routes of a stacked tensor: a tensor made of its parts laid out as blocks of rows (``plan.combine.Stack``),
such as transformers' fused MoE experts built from one checkpoint tensor per expert.

::

    stacked        the tensor allocated once, in its dtype, on its device (a shard: this rank's local part);
                   each part, or the rows of it this rank holds, read straight into its rows (cast and moved
                   through the scratch buffer when it is stored otherwise)
    stacked rows   quantized a block of rows at a time: each block read from the parts that hold its rows into one
                   reused buffer, cast, moved and quantized; the whole tensor never exists in full precision

Each part is read once, and never beside a copy of the whole layer: the peak is the final model plus about one
part (one block of rows when quantized), where combining the parts holds them all and the result together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from lightning_lowmem.routes.reader import Payload, Reader, local_of
from lightning_lowmem.routes.route import Route, Traits, by_rows_nbytes, decode, freed_heap, row_blocks
from lightning_lowmem.plan import Target
from lightning_lowmem.quantize.rows import RowSource


def stackable(target: Target, traits: Traits, by_rows: bool) -> bool:
    """Whether ``target``'s parts can be read into their rows on its route: no transform runs on the whole tensor,
    no other target reads the same parts, and each part's rows can be read on their own where the route reads
    only some of them (a shard's rows, blocks of rows)."""
    if traits.transform or any(p.key in traits.shared for p in target.parts):
        return False
    partial = by_rows or target.shard is not None
    return not partial or all(traits.reads_rows(p.key) for p in target.parts)


def _copied(target: Target) -> bool:
    """Whether a part goes into the tensor through a copy (another dtype or device than it is stored in)."""
    return target.device.type != "cpu" or any(p.dtype != target.dtype or p.encoding for p in target.parts)


@dataclass(frozen=True)
class Stacked(Route):
    """Each part (this rank's rows of it) read straight into its rows of the tensor, allocated once."""

    kind: ClassVar[str] = "stacked"

    def read(self, reader: Reader) -> Payload:
        target = self.target
        if target.shard is not None:
            out = local_of(reader.module, target)  # this rank's part: filled in place
        else:
            out = reader.final_out(target.record.shape, target.dtype) if target.device.type == "cpu" else None
            out = torch.empty(target.record.shape, dtype=target.dtype, device=target.device) if out is None else out
        rows = out.view(-1, *target.stack.tail)  # (stack rows, *tail)
        for part, start, stop, at in target.pieces():
            reader.fill(part, start, stop, rows[at:at + stop - start])
        return out

    @property
    def largest_piece(self) -> int:
        return max((p.tensor_nbytes // max(p.shape[0], 1) * (stop - start)
                    for p, start, stop, _ in self.target.pieces()), default=0)

    @property
    def transient(self) -> int:
        target = self.target
        held = self.largest_piece if _copied(target) else 0
        if target.scheme is not None:  # quantized whole (a scheme that does not work by rows)
            cast = target.cast_nbytes
            held = max(cast + held, cast + target.scheme.transient_nbytes(target.record.numel)) + freed_heap(target)
        return held + decode(target)

    @property
    def final(self) -> bool:
        return self.target.scheme is None and not _copied(self.target)

    @property
    def scratch_nbytes(self) -> int:
        return self.largest_piece if _copied(self.target) else 0


@dataclass(frozen=True)
class StackedRows(Route):
    """A stacked weight quantized a block of rows at a time, each block read from the parts that hold its rows into
    the load's row buffer (one per thread); several blocks at once on the load's row workers when each part is read
    straight into the block (stored in one dtype: no part goes through the shared scratch buffer)."""

    kind: ClassVar[str] = "stacked rows"

    @property
    def blocks(self) -> int:
        """``route.row_blocks``; one where the parts are stored in several dtypes (read through the scratch buffer)."""
        return row_blocks(self.target) if len({p.dtype for p in self.target.parts}) == 1 else 1

    def read(self, reader: Reader) -> Payload:
        target, tail = self.target, self.target.stack.tail
        total = target.record.numel // max(math.prod(tail), 1)
        dtypes = {p.dtype for p in target.parts}
        read_dtype = dtypes.pop() if len(dtypes) == 1 else target.dtype

        def rows(start: int, stop: int) -> torch.Tensor:
            if start == 0 and stop == total:  # the whole weight: its own memory, nothing shared
                block = torch.empty((stop - start, *tail), dtype=read_dtype, device="cpu")
            else:
                block = reader.rows.view((stop - start, *tail), read_dtype)
            lengths = [p.shape[0] for p in target.parts]
            for i, lo, hi, at in target.stack.pieces(lengths, start, stop):
                reader.fill(target.parts[i], lo, hi, block[at:at + hi - lo])
            return block.to(dtype=target.dtype).to(device=target.device)

        workers = reader.workers if self.blocks > 1 else None
        return RowSource((total, *tail), target.dtype, target.device, rows, workers)

    @property
    def transient(self) -> int:
        return by_rows_nbytes(self.target, self.blocks) + decode(self.target)
