"""The routes of the device path: a tensor read through the ring onto its device (``staging.py``).

::

    staged         the tensor allocated once on the device, in its dtype; read a piece at a time into the ring,
                   cast there when that makes it smaller, copied in on the copy engine
    staged stack   the same for a tensor made of its parts laid out as blocks of rows (litgpt's qkv from
                   HF q, k and v; transformers' fused experts): each part copied straight into its rows

A weight to quantize arrives whole on the device and is quantized there in one call per weight
(``quantize/rows.py``: blocks of rows are for the CPU's caches and threads).

Which tensors take them (:func:`stageable`): those going to the load's device path device (``Traits.staged``), whole
on this rank, stored plainly (not block-quantized, not stored quantized), touched by no transform, and whose rows
the file reads on their own. The others go as they always did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lightning_lowmem.transfer.copies import CopyEngine
from lightning_lowmem.routes.reader import Payload, Reader
from lightning_lowmem.routes.route import Route, Traits
from lightning_lowmem.routes.stacked import stackable
from lightning_lowmem.routes.staging import Fill
from lightning_lowmem.formats import TensorRecord
from lightning_lowmem.plan import Target
from lightning_lowmem.plan.transform import row_block


def stageable(target: Target, traits: Traits) -> bool:
    """Whether ``target`` goes through the device path (see the module docstring)."""
    if traits.staged is None or target.device != traits.staged or target.shard is not None or target.stored:
        return False
    records = target.parts or (target.record,)
    if any(r.encoding or not r.shape or not traits.reads_rows(r.key) for r in records):
        return False
    if target.parts:
        return target.stack is not None and stackable(target, traits, by_rows=True)
    return row_block(traits.transform, target.names[0]) == 0


def staged_route(target: Target) -> Route:
    return StagedStack(target) if target.parts else Staged(target)


@dataclass(frozen=True)
class Staged(Route):
    """Read through the ring into its tensor on the device (quantized there after, when marked)."""

    kind: ClassVar[str] = "staged"

    def read(self, reader: Reader) -> Payload:
        return reader.staged.take(self.target)

    def fills(self, engine: CopyEngine) -> tuple[torch.Tensor, list[Fill]]:
        """Its tensor on the device, and what fills it (called in a reading thread)."""
        rec = self.target.record
        out = engine.empty(rec.shape, self.target.dtype)
        return out, [Fill(rec, 0, rec.shape[0], out)]

    @property
    def specs(self) -> list[tuple[TensorRecord, torch.dtype, int]]:
        """``(record, dtype it is copied into, rows)`` of each record read: what sizes the ring."""
        return [(self.target.record, self.target.dtype, self.target.record.shape[0])]

    @property
    def staged(self) -> bool:
        return True

    @property
    def final(self) -> bool:
        return self.target.scheme is None

    @property
    def held_nbytes(self) -> int:
        """Device bytes it holds from its read until it is installed, beyond the final tensor: the whole weight,
        when it is quantized after."""
        return 0 if self.final else self.target.cast_nbytes

    @property
    def transient(self) -> int:
        """Beyond the final tensor, on the device: a weight to quantize, whole in its dtype, and what quantizing it
        holds (the scheme's measure, made on the CPU; unmeasured on a GPU). The host holds only the ring."""
        t = self.target
        return 0 if t.scheme is None else t.cast_nbytes + t.scheme.transient_nbytes(t.record.numel)


@dataclass(frozen=True)
class StagedStack(Staged):
    """A stacked tensor through the ring: each part copied into its rows of the tensor, allocated once on the
    device."""

    kind: ClassVar[str] = "staged stack"

    def fills(self, engine: CopyEngine) -> tuple[torch.Tensor, list[Fill]]:
        t = self.target
        out = engine.empty(t.record.shape, t.dtype)
        rows = out.view(-1, *t.stack.tail)  # (stack rows, *tail)
        return out, [Fill(part, start, stop, rows[at:at + stop - start]) for part, start, stop, at in t.pieces()]

    @property
    def specs(self) -> list[tuple[TensorRecord, torch.dtype, int]]:
        return [(part, self.target.dtype, stop - start) for part, start, stop, _ in self.target.pieces()]
