"""The disk tier: the layers left in the checkpoint file, each read for its own forward while the one before it
computes: the layer streamer (``streamer.py``) with the file as its source (``file_reads.py``).

::

    DiskTier(root, units, read, description, device)
        placeholders in the modules on disk, hooks on, the first layer's read started (while the model is handed out)
        each forward: every layer on disk read once (tied modules too), in the order the forward takes, cyclic: the
        first layer's read for the next forward starts as this one ends
        close(): hooks off, the layers on disk back on meta, the reading thread stopped, the file closed

Built by the load (``engine/disk_reads.py``: it gives the reading along the load's routes), and handed out as
``LoadReport.disk``.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from lightning_lowmem.memory import format_bytes
from lightning_lowmem.runtime.disk_units import DiskUnit
from lightning_lowmem.runtime.file_reads import FileReads, ReadLayer
from lightning_lowmem.runtime.streamer import LayerStreamer


class DiskTier(LayerStreamer):
    """Hooks that read each layer on disk for its forward, the next one read meanwhile.

    :meth:`close` (or :meth:`remove`) takes the hooks off, puts those modules' tensors back on meta and closes the
    checkpoint it owns; dropping the model does the same at once. Inference only: a forward with autograd enabled
    raises. ``stats`` (a :class:`~lightning_lowmem.runtime.streamer.StreamStats`) counts the reads.

    Args:
        root: the loaded model.
        units: the layers on disk, in module order.
        read: reads a layer into a buffer along the load's routes (``engine/disk_reads.py``).
        description: the checkpoint's files, for messages.
        device: the execution device.
    """

    def __init__(self, root: nn.Module, units: list[DiskUnit], read: ReadLayer, *, description: str,
                 device: torch.device | str) -> None:
        device = torch.device(device)
        source = FileReads(root, units, read, description=description, device=device)
        modules = {name: root.get_submodule(name) for unit in units for name in unit.modules}
        super().__init__(root, modules, source, device)
        self._prefetch(next(iter(modules)))  # the first layer is read while the model is handed out

    @property
    def units(self) -> dict[str, DiskUnit]:
        """Layer name -> the layer on disk."""
        return self.source.units

    @property
    def buffer_bytes(self) -> int:
        """Host memory of the read buffers: two of the largest layer on disk, and one per layer of tied modules."""
        return self.source.buffers.nbytes

    @property
    def read_nbytes(self) -> int:
        """Bytes read from the checkpoint for each forward (every layer on disk once, tied ones too)."""
        return sum(u.read_nbytes for u in self.units.values())

    @property
    def streaming(self) -> str:
        return f"layers are read from the checkpoint file for each forward (disk_offload: {self.source.description})"

    def stored_modules(self) -> dict[str, str]:
        """Module name -> scheme, for the modules on disk whose weight the checkpoint holds quantized."""
        return {t.names[0].rpartition(".")[0]: t.scheme.name for u in self.units.values() for t in u.targets
                if t.stored is not None}

    def own(self, resources: contextlib.ExitStack) -> None:
        """Close ``resources`` (the load's open checkpoint) with the tier."""
        self.source.own(resources)

    def __enter__(self) -> DiskTier:
        return self

    def __str__(self) -> str:
        return (f"{len(self.units)} layers read from {self.source.description} for each forward: "
                f"{format_bytes(self.read_nbytes)} per forward, into {format_bytes(self.buffer_bytes)} of buffers")
