"""What a route is (``routes.py`` has them all, and the one decision): the base class, the traits of a load that a
tensor's route depends on, and the sizes the routes share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from lightning_lowmem.routes.reader import Payload, Reader
from lightning_lowmem.routes.row_reads import Transform
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.formats.gguf_file import DEQUANTIZE_WORKSPACE
from lightning_lowmem.plan import LoadPlan, Target
from lightning_lowmem.quantize.quantizer import TRIM_AT
from lightning_lowmem.quantize.rows import CHUNK_ELEMENTS
from lightning_lowmem.quantize.workers import row_workers


@dataclass(frozen=True)
class Traits:
    """What the whole load is, that a tensor's route depends on.

    Attributes:
        transform: the transform the conversion runs on each tensor as read, or None.
        mapped: the whole load maps the file (``stream.mappable``).
        reads_rows: whether a block of rows of a checkpoint key can be read on its own.
        shared: checkpoint keys that several targets are built from (read once, held between them).
        requantized: weight names built from weights stored quantized, then quantized again.
        staged: the device whose tensors go through the device path's ring (``staged.py``), or None.
    """

    transform: Transform | None = None
    mapped: bool = False
    reads_rows: Callable[[str], bool] = field(default=lambda key: True)  # records with no file: as any file
    shared: frozenset[str] = frozenset()
    requantized: frozenset[str] = frozenset()
    staged: torch.device | None = None

    @classmethod
    def of(cls, plan: LoadPlan, ckpt: Checkpoint | None, *, transform: Transform | None, mapped: bool = False,
           requantized: frozenset[str] = frozenset(), staged: torch.device | None = None) -> Traits:
        """The traits of a load of ``plan`` from ``ckpt`` (None: records with no file, read as any file reads)."""
        uses: dict[str, int] = {}
        for target in plan.targets:
            for part in target.parts:
                uses[part.key] = uses.get(part.key, 0) + 1
        shared = frozenset(k for k, n in uses.items() if n > 1)
        if ckpt is None:
            return cls(transform, mapped, shared=shared, requantized=requantized, staged=staged)
        return cls(transform, mapped, ckpt.reads_rows, shared, requantized, staged)


@dataclass(frozen=True)
class Route:
    """How one target is read, and what that holds beyond the final tensor. Subclasses are the routes."""

    target: Target
    kind: ClassVar[str] = ""

    def read(self, reader: Reader) -> Payload:
        """What the stream installs: a tensor, a :class:`RowSource`, or the parts of a weight stored quantized."""
        raise NotImplementedError

    @property
    def transient(self) -> int:
        """Bytes held beyond the final tensor while this target is read, cast, quantized and assigned."""
        raise NotImplementedError

    @property
    def read_nbytes(self) -> int:
        """Bytes read from the checkpoint for this target."""
        return self.target.read_nbytes

    @property
    def final(self) -> bool:
        """Whether what is read becomes the final tensor as it is (so reading it ahead costs nothing)."""
        return False

    @property
    def transformed(self) -> bool:
        """Whether the route ran the load's transform on what it read already (the stream does not run it again)."""
        return False

    @property
    def scratch_nbytes(self) -> int:
        """The largest read this route makes into the reused scratch buffer (0: none)."""
        return 0

    @property
    def blocks(self) -> int:
        """Blocks of rows read and quantized at once along this route (more than one: on the load's row workers)."""
        return 1

    @property
    def staged(self) -> bool:
        """Whether it goes through the device path's ring (``staged.py``): read ahead by the stager, not here."""
        return False


def as_read(target: Target) -> int:
    """Bytes of the tensor as read, when it is then cast (both live at once); 0 when read in its final dtype."""
    return target.record.numel * target.record.dtype.itemsize if target.record.dtype != target.dtype else 0


def decode(target: Target) -> int:
    """The dequantization workspace of a tensor stored block-quantized (GGUF), else 0."""
    return DEQUANTIZE_WORKSPACE if any(r.encoding for r in (target.record, *target.parts)) else 0


def by_rows_nbytes(target: Target, blocks: int = 1) -> int:
    """Up to ``blocks`` blocks of rows (as many as are in flight at once: one per row worker, ``quantize/workers.py``;
    never more than the whole weight) as read, cast and quantized, and the freed heap a trim leaves: up to
    ``TRIM_AT`` bytes, the earlier weights' temporaries (measured on a Mixtral stack quantized to nf4: 15-32 MiB
    beyond the final tensors from run to run, where one block's allowance gave 19 MiB)."""
    numel = min(target.record.numel, blocks * CHUNK_ELEMENTS)
    working = numel * (target.record.dtype.itemsize + target.dtype.itemsize) + target.scheme.transient_nbytes(numel)
    return working + freed_heap(target)


def row_blocks(target: Target) -> int:
    """Blocks of rows of ``target`` read and quantized at once on its route: one per row worker for a weight quantized
    on the CPU (``quantize/workers.py``), else one (a file that decodes its blocks, GGUF, reads one at a time)."""
    return 1 if decode(target) else row_workers(target.device)


def quantized_nbytes(target: Target, held: int) -> int:
    """What quantizing ``target`` from a whole tensor holds, ``held`` bytes (as read, parts) beside its cast copy."""
    cast = target.cast_nbytes
    if target.scheme.by_rows:  # quantized a block of rows of the whole cast tensor at a time
        return held + cast + by_rows_nbytes(target)
    return max(held + cast, cast + target.scheme.transient_nbytes(target.record.numel)) + freed_heap(target)


def freed_heap(target: Target) -> int:
    """The freed heap a quantized weight may find resident: the earlier weights' temporaries, handed back only once
    ``TRIM_AT`` bytes are free (``Quantizer.load``); 0 for a target not quantized. Whether they are resident when
    this one is quantized cannot be known before the load: the bound."""
    return TRIM_AT if target.scheme is not None else 0
