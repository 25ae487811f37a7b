"""How each tensor of a load travels from the file into the module, and what it holds meanwhile: one route per target.

::

    route_of(target, traits)   decided once per target, from the target (its parts and how they stack, its shard,
                               its scheme, dtype and device), the load's transform and what the checkpoint can do
        mapped         a view of the file's mapped pages (a load that maps)
        whole          read whole; a copy to be cast, moved or quantized goes into the reused scratch buffer
        rows           quantized a block of rows at a time, each block read on its own (and rewritten by the
                       transform, when it takes blocks of rows)
        built rows     kept unquantized and built a block of rows at a time into the final tensor: read
                       (a GGUF block dequantized), rewritten by the transform, cast (``row_reads.py``)
        combined       its parts read (fresh memory each), then combined by the conversion's ``fn``
        stacked        its parts read straight into their rows of the tensor, allocated once (``stacked.py``)
        stacked rows   the same, quantized a block of rows at a time (``stacked.py``)
        stored         the parts of a weight stored quantized, as they are
        staged (stack) onto a device with a device path: through a ring of host buffers, several tensors at once,
                       copies overlapped with the next reads; quantized on the device whole (``staged.py``)
        shard rows     this rank's rows of a DTensor, read straight into its local part
        quantized shard rows   this rank's rows of a weight, read and quantized alone (a scheme that
                       ``shards_by_rows``: one all-reduce per weight, ``shard_sums.py``)

The stream asks a target's route to read it (:meth:`Route.read`); the estimate asks the same route what it
holds beyond the final tensor while it is streamed in (:attr:`Route.transient`), so that the estimate cannot
drift from the loop. Sizes, as ``engine/memory_estimate.py`` states them: a tensor as read beside its cast
copy; a block of rows as read, cast and quantized (``QuantScheme.transient`` bytes per element) and the freed
heap a trim leaves (``TRIM_AT``); a combined tensor's parts; a block-quantized (GGUF) tensor's dequantization
workspace (``DEQUANTIZE_WORKSPACE``).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import ClassVar

import torch

from lightning_lowmem.routes.reader import Payload, Reader, local_of
from lightning_lowmem.routes.route import (
    Route,
    Traits,
    as_read,
    by_rows_nbytes,
    decode,
    quantized_nbytes,
    row_blocks,
)
from lightning_lowmem.routes.row_reads import block_rows, built_by_rows, read_built, reads_by_rows, rows_reader
from lightning_lowmem.routes.stacked import Stacked, StackedRows, stackable
from lightning_lowmem.routes.staged import stageable, staged_route
from lightning_lowmem.plan import Target, row_block
from lightning_lowmem.quantize.rows import RowSource


def route_of(target: Target, traits: Traits) -> Route:
    """The one decision of how ``target`` travels (see the module docstring)."""
    if target.shard is not None and target.own_rows is not None and not traits.transform:
        if target.scheme is not None:
            if quantized_alone(target) and traits.reads_rows(target.record.key):
                return QuantizedShardRows(target)
        elif target.stack is not None and stackable(target, traits, by_rows=True):
            return Stacked(target)
        elif not target.parts and traits.reads_rows(target.record.key):
            return ShardRows(target)
    if stageable(target, traits):
        return staged_route(target)
    if traits.mapped:
        return Mapped(target)
    if target.stored is not None:
        return Stored(target)
    if target.parts:
        by_rows = target.scheme is not None and target.scheme.by_rows
        if target.stack is not None and target.shard is None and stackable(target, traits, by_rows):
            return StackedRows(target) if by_rows else Stacked(target)
        return Combined(target, requantized=target.names[0] in traits.requantized)
    rows = reads_by_rows(target, traits.transform, traits.reads_rows(target.record.key))
    if target.scheme is not None and target.scheme.by_rows and len(target.record.shape) == 2 and rows:
        return Rows(target, rewritten=bool(row_block(traits.transform, target.names[0])))
    if built_by_rows(target, traits.transform, traits.reads_rows(target.record.key)):
        return BuiltRows(target, block=block_rows(target, traits.transform),
                         rewritten=bool(row_block(traits.transform, target.names[0])))
    return Whole(target)


# ---- the routes

@dataclass(frozen=True)
class Mapped(Route):
    """A view of the file's mapped pages (read plainly where the file cannot map it)."""

    kind: ClassVar[str] = "mapped"

    def read(self, reader: Reader) -> Payload:
        tensor = reader.ckpt.map(self.target.record.key)
        return tensor if tensor is not None else reader.ckpt.read(self.target.record.key)

    @property
    def transient(self) -> int:
        return 0

    @property
    def read_nbytes(self) -> int:
        return 0

    @property
    def final(self) -> bool:
        return True


@dataclass(frozen=True)
class Whole(Route):
    """Read whole: the final tensor as read, or a copy cast, moved, quantized or cut to this rank's part."""

    kind: ClassVar[str] = "whole"

    @property
    def copied(self) -> bool:
        t = self.target
        return t.shard is not None or t.dtype != t.record.dtype or t.device.type != "cpu" or t.scheme is not None

    def read(self, reader: Reader) -> Payload:
        rec = self.target.record
        out = reader.scratch_view(rec.shape, rec.dtype) if self.copied else reader.final_out(rec.shape, rec.dtype)
        return reader.ckpt.read(rec.key, out=out)

    @property
    def transient(self) -> int:
        t = self.target
        if t.shard is not None:  # the whole tensor as read (and cast), this rank's part copied out of it
            cast = t.record.numel * t.dtype.itemsize if t.dtype != t.record.dtype or t.scheme is not None else 0
            quantize = t.scheme.transient_nbytes(t.record.numel) if t.scheme is not None else 0
            return t.record.tensor_nbytes + cast + quantize + decode(t)
        if t.scheme is None:
            return as_read(t) + decode(t)
        return quantized_nbytes(t, as_read(t)) + decode(t)

    @property
    def read_nbytes(self) -> int:
        return self.target.record.nbytes

    @property
    def final(self) -> bool:
        return not self.copied

    @property
    def scratch_nbytes(self) -> int:
        return self.target.record.tensor_nbytes if self.copied else 0


@dataclass(frozen=True)
class Rows(Route):
    """A weight quantized a block of rows at a time, each block read from the file into the load's row buffer (and
    rewritten by the transform when it takes blocks of rows: ``rewritten``); on the CPU, several blocks at once on
    the load's row workers (``quantize/workers.py``), each into a buffer of its own thread."""

    rewritten: bool = False
    kind: ClassVar[str] = "rows"

    def read(self, reader: Reader) -> Payload:
        target = self.target
        rows = rows_reader(reader.ckpt, target, reader.transform, reader.rows)
        return RowSource(target.record.shape, target.dtype, target.device,
                         lambda start, stop: rows(start, stop).to(dtype=target.dtype).to(device=target.device),
                         reader.workers if self.blocks > 1 else None)

    @property
    def blocks(self) -> int:
        return row_blocks(self.target)

    @property
    def transient(self) -> int:
        return by_rows_nbytes(self.target, self.blocks) + decode(self.target)

    @property
    def transformed(self) -> bool:
        return self.rewritten


@dataclass(frozen=True)
class BuiltRows(Route):
    """A tensor kept unquantized, built a block of ``block`` rows at a time into its final tensor: each block read
    into the load's row buffer (a GGUF block dequantized), rewritten by the transform (``rewritten``) and cast
    into place; the tensor is never whole in float32."""

    block: int = 1
    rewritten: bool = False
    kind: ClassVar[str] = "built rows"

    def read(self, reader: Reader) -> Payload:
        target = self.target
        out = reader.final_out(target.record.shape, target.dtype) if target.device.type == "cpu" else None
        return read_built(reader.ckpt, target, reader.transform, reader.rows, out)

    @property
    def transient(self) -> int:
        rec = self.target.record
        block = self.block * (rec.numel // max(rec.shape[0], 1)) * rec.dtype.itemsize
        return block * (2 if self.rewritten else 1) + decode(self.target)

    @property
    def transformed(self) -> bool:
        return True


@dataclass(frozen=True)
class Combined(Route):
    """Parts read one after the other (fresh memory each, or held for a later target that shares them), then
    combined by the conversion's ``fn``; the parts are dropped once it is built.

    Attributes:
        requantized: the parts are weights stored quantized, held dequantized (about the cast size) meanwhile.
    """

    requantized: bool = False
    kind: ClassVar[str] = "combined"

    def read(self, reader: Reader) -> Payload:
        target = self.target
        tensor = reader.combine.fn(target.record.key, {p.key: reader.parts.take(p.key) for p in target.parts})
        if tensor.untyped_storage().nbytes() > tensor.nbytes:  # a slice of a part would keep the whole part alive
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        return tensor

    @property
    def transient(self) -> int:
        t = self.target
        parts = sum(p.tensor_nbytes for p in t.parts) + (t.cast_nbytes if self.requantized else 0)
        if t.scheme is None:
            return as_read(t) + parts + decode(t)
        return quantized_nbytes(t, as_read(t) + parts) + decode(t)

    @property
    def read_nbytes(self) -> int:
        return sum(r.nbytes for r in self.target.parts)


@dataclass(frozen=True)
class Stored(Route):
    """The parts of a weight the checkpoint holds quantized, read as they are and handed to its scheme."""

    kind: ClassVar[str] = "stored"

    def read(self, reader: Reader) -> Payload:
        return {p.key: reader.ckpt.read(p.key, out=reader.final_out(p.shape, p.dtype)) for p in self.target.parts}

    @property
    def transient(self) -> int:  # on CPU the parts read are the final tensors
        t = self.target
        return sum(p.tensor_nbytes for p in t.parts) if t.device.type != "cpu" else 0


@dataclass(frozen=True)
class ShardRows(Route):
    """This rank's rows of a DTensor: read straight into its local part when stored as it is kept, else into
    scratch and copied."""

    kind: ClassVar[str] = "shard rows"

    @property
    def copied(self) -> bool:
        return self.target.dtype != self.target.record.dtype or self.target.device.type != "cpu"

    def read(self, reader: Reader) -> Payload:
        target, rec = self.target, self.target.record
        start, stop = target.own_rows
        local = local_of(reader.module, target)
        if start == stop:
            return local
        if not self.copied and local.is_contiguous():
            return reader.read(rec, start, stop, out=local)
        return reader.read(rec, start, stop, out=reader.scratch_view((stop - start, *rec.shape[1:]), rec.dtype))

    @property
    def rows_nbytes(self) -> int:
        rec, (start, stop) = self.target.record, self.target.own_rows
        return rec.tensor_nbytes // max(rec.shape[0], 1) * (stop - start)

    @property
    def transient(self) -> int:
        return (self.rows_nbytes if self.copied else 0) + decode(self.target)

    @property
    def final(self) -> bool:
        return not self.copied

    @property
    def scratch_nbytes(self) -> int:
        return self.rows_nbytes if self.copied else 0


def quantized_alone(target: Target) -> bool:
    """Whether this rank's rows of the quantized shard ``target`` can be quantized on their own: its scheme
    ``shards_by_rows`` and its rows are one of several plain ``torch.chunk`` pieces the scheme's blocks split into."""
    shard, scheme = target.shard, target.scheme
    if not getattr(scheme, "shards_by_rows", False) or target.parts or len(target.record.shape) != 2:
        return False
    return shard.count > 1 and scheme.shard_reason(target.record.shape, shard.count) is None


@dataclass(frozen=True)
class QuantizedShardRows(ShardRows):
    """This rank's rows of a weight quantized on their own (:meth:`Transform.quantize_own_rows`): read into fresh
    memory (or scratch, when cast), cast; the whole weight is never read on this rank."""

    kind: ClassVar[str] = "quantized shard rows"

    def read(self, reader: Reader) -> Payload:
        rec, (start, stop) = self.target.record, self.target.own_rows
        out = reader.scratch_view((stop - start, *rec.shape[1:]), rec.dtype) if self.copied else None
        return reader.read(rec, start, stop, out=out)

    @property
    def transient(self) -> int:
        """Its rows as read and cast, quantizing them by blocks of rows (``by_rows_nbytes``), and the quantized
        shard, made before it is copied into place."""
        t = self.target
        return self.rows_nbytes + (t.cast_nbytes if self.copied else 0) + by_rows_nbytes(t) + t.final_nbytes \
            + decode(t)

    @property
    def final(self) -> bool:
        return False
