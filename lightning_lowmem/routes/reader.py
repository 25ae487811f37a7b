"""What the routes read with: the open checkpoint, the module, one reused scratch buffer and the parts that several
targets share (see ``routes.py``)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from lightning_lowmem.routes.readahead import ScratchBuffer
from lightning_lowmem.routes.row_reads import RowBuffer, Transform
from lightning_lowmem.ranks.shard_fill import local_tensor
from lightning_lowmem.formats import Checkpoint, TensorRecord
from lightning_lowmem.meta import owner_of
from lightning_lowmem.plan import Combine, LoadPlan, Target
from lightning_lowmem.quantize.rows import RowSource
from lightning_lowmem.quantize.workers import RowWorkers

Payload = torch.Tensor | RowSource | dict[str, torch.Tensor]
"""What a route hands the stream: a tensor, a weight a block of rows at a time, or the parts of a weight stored
quantized (by checkpoint key)."""


class Reader:
    """What routes read with: the checkpoint, the module (for a shard's local part), the reused scratch buffer, the
    buffer blocks of rows are read into, the parts several targets share, the conversion's ``combine`` and
    ``transform``, and the threads that read and quantize blocks of rows (``workers``; None: one block at a time).

    ``destination``, when set, gives the memory a final tensor is read into (the disk tier's layer buffer,
    ``disk_reads.py``); without it each final tensor is new memory. ``module`` may be None where no DTensor shard
    is read (the disk tier, which must not hold the model).
    """

    def __init__(self, module: nn.Module | None, ckpt: Checkpoint, plan: LoadPlan, combine: Combine | None,
                 scratch_size: int = 0, transform: Transform | None = None, workers: RowWorkers | None = None) -> None:
        self.module, self.ckpt, self.combine, self.transform = module, ckpt, combine, transform
        self.workers = workers
        self.scratch = ScratchBuffer(scratch_size) if scratch_size else None
        self.scratch_size = scratch_size
        self.parts = SharedParts(ckpt, plan)
        self.rows = RowBuffer()  # the one buffer blocks of rows are read into (row_reads.py)
        self.destination: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None
        self.staged = None  # the device path's stager (staging.py), when the load has one

    def final_out(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Where a tensor read as it is kept goes: a view of ``destination`` when set, else None (new memory)."""
        return self.destination(shape, dtype) if self.destination is not None else None

    def scratch_view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A view of the scratch buffer of ``shape`` and ``dtype``, or None when there is none that large."""
        if self.scratch is None or math.prod(shape) * dtype.itemsize > self.scratch_size:
            return None
        return self.scratch.view(shape, dtype)

    def read(self, rec: TensorRecord, start: int | None = None, stop: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """``rec`` whole, or its rows ``start:stop``, into ``out`` when given (a new tensor otherwise)."""
        if start is None or (start == 0 and stop == rec.shape[0]):
            return self.ckpt.read(rec.key, out=out)
        return self.ckpt.read_rows(rec.key, start, stop, out=out)

    def fill(self, rec: TensorRecord, start: int, stop: int, into: torch.Tensor) -> None:
        """Rows ``start:stop`` of ``rec`` into ``into`` (any dtype and device): read straight into it when it holds
        them as stored, else read into scratch (or fresh memory) and copied."""
        if into.dtype == rec.dtype and into.device.type == "cpu" and into.is_contiguous() and rec.encoding is None:
            got = self.read(rec, start, stop, out=into)
            if got.data_ptr() != into.data_ptr():  # a strided view stored in a torch file comes back new
                into.copy_(got)
            return
        into.copy_(self.read(rec, start, stop, out=self.scratch_view((stop - start, *rec.shape[1:]), rec.dtype)))


def local_of(module: nn.Module, target: Target) -> torch.Tensor:
    """This rank's local part of the DTensor ``target`` fills."""
    owner, leaf = owner_of(module, target.names[0])
    return local_tensor(getattr(owner, leaf))


class SharedParts:
    """Reads the parts of combined targets; a part that a later target also needs is read once and held till then.

    litgpt splits Phi-3's ``gate_up_proj`` into ``fc_1`` and ``fc_2``: without this it was read twice.
    """

    def __init__(self, ckpt: Checkpoint, plan: LoadPlan) -> None:
        self._ckpt = ckpt
        self._uses: dict[str, int] = {}
        for target in plan.targets:
            for part in target.parts:
                self._uses[part.key] = self._uses.get(part.key, 0) + 1
        self._held: dict[str, torch.Tensor] = {}

    def take(self, key: str) -> torch.Tensor:
        tensor = self._held.pop(key, None)
        if tensor is None:
            tensor = self._ckpt.read(key)
        self._uses[key] -= 1
        if self._uses[key] > 0:
            self._held[key] = tensor
        return tensor
