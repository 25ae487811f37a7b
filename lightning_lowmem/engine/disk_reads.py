"""The disk tier of a load (``runtime/disk_tier.py``): its layers, and how it reads them: each tensor along the route
the load would take (``routes.py``), into its slot of a layer buffer.

::

    open_disk_tier(prepared, ckpt)   the layers the placement left on disk -> DiskUnits -> DiskTier, its reads
                                     given by LayerReads
    LayerReads(ckpt, units, traits)  a layer read into a buffer: each tensor read there as it is kept when it can
                                     be, else read, cast or transformed and copied in; a weight stored quantized
                                     read as stored, its parts into their slots; the file checked unchanged after

The runtime sits below the engine: it streams layers and knows no route; the engine hands it this reading.
"""

from __future__ import annotations

import torch

from lightning_lowmem.engine.prepare import PreparedLoad
from lightning_lowmem.routes.reader import Payload, Reader, SharedParts
from lightning_lowmem.routes.route import Route, Traits
from lightning_lowmem.routes.choice import route_of
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.plan import Combine, LoadPlan, Target
from lightning_lowmem.plan.conversions import Transform
from lightning_lowmem.quantize.layouts import layout_of
from lightning_lowmem.runtime.disk_tier import DiskTier
from lightning_lowmem.runtime.disk_units import DiskUnit
from lightning_lowmem.runtime.layer_buffers import Slot, view


def open_disk_tier(prepared: PreparedLoad, ckpt: Checkpoint) -> DiskTier | None:
    """The disk tier of a prepared load whose placement left layers on disk (None when it left none): placeholders
    in their modules, hooks on, the first one's read started."""
    layers = prepared.execution.on_disk if prepared.execution is not None else []
    if not layers:
        return None
    targets = on_disk_targets(prepared)
    units = []
    for layer in layers:
        names = set(layer.tensors)
        units.append(DiskUnit.of(layer.name, list(layer.modules), [t for t in targets if t.names[0] in names]))
    traits = Traits.of(LoadPlan(targets), ckpt, transform=prepared.transform)
    reads = LayerReads(ckpt, units, traits, combine=prepared.combine, transform=prepared.transform)
    return DiskTier(prepared.module, units, reads, description=ckpt.description, device=prepared.device)


def on_disk_targets(prepared: PreparedLoad) -> list[Target]:
    """The targets of a prepared load that stay in the checkpoint file (none without a disk tier)."""
    placement = prepared.placement
    if placement is None or not placement.on_disk:
        return []
    return [t for t in prepared.plan.targets if placement.is_on_disk(t.names[0])]


class LayerReads:
    """Reads a layer on disk into a buffer, each tensor along the route the load took for it.

    Args:
        ckpt: the open checkpoint.
        units: the layers on disk.
        traits: the load's traits (each tensor takes the route it took at load).
        combine, transform: the load's conversion.
    """

    def __init__(self, ckpt: Checkpoint, units: list[DiskUnit], traits: Traits, *, combine: Combine | None,
                 transform: Transform | None) -> None:
        self.ckpt = ckpt
        self._transform = transform
        self._routes = {id(t): route_of(t, traits) for unit in units for t in unit.targets}
        scratch = max((r.scratch_nbytes for r in self._routes.values()), default=0)
        self._reader = Reader(None, ckpt, LoadPlan([]), combine, scratch, transform)  # no shard on disk: no module

    def __call__(self, unit: DiskUnit, buffer: torch.Tensor) -> list[Payload]:
        """``unit``'s tensors read into ``buffer``, one per target; runs on the disk tier's reading thread."""
        reader = self._reader
        reader.parts = SharedParts(self.ckpt, LoadPlan(unit.targets))  # parts two of its targets share: read once
        tensors = [self._read(buffer, target, self._routes[id(target)], slots)
                   for target, slots in zip(unit.targets, unit.slots)]
        self.ckpt.check_unchanged()  # a write during these reads: not these bytes
        return tensors

    def _read(self, buffer: torch.Tensor, target: Target, route: Route, slots: list[Slot]) -> Payload:
        """``target`` read along ``route`` into its slots: as it is kept when it can be, else read, converted and
        copied in."""
        reader = self._reader
        views = [view(buffer, slot) for slot in slots]
        free = iter(views)
        direct = self._transform is None or target.stored is not None or route.transformed  # built in place

        def destination(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
            out = next(free, None)
            return out if out is not None and tuple(out.shape) == tuple(shape) and out.dtype == dtype else None

        reader.destination = destination if direct else None
        try:
            payload = route.read(reader)
        finally:
            reader.destination = None
        if isinstance(payload, dict):  # a weight stored quantized: its parts, as stored
            layout_of(target.scheme).check_read(target.stored, {r: payload[rec.key] for r, rec in
                                                                target.stored.roles.items()})  # here, on the host
            return {p.key: _into(payload[p.key], out) for p, out in zip(target.parts, views)}
        if not isinstance(payload, torch.Tensor):
            raise RuntimeError(f"{target.names[0]!r} would be quantized for each forward; check_streamable refuses "
                               "that before any read.")
        if self._transform is not None and not route.transformed:  # a route that took blocks of rows ran it already
            payload = self._transform(target.names[0], payload)
        return _into(payload, views[0])


def _into(tensor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` holding ``tensor`` (nothing copied when ``tensor`` is ``out`` already)."""
    if tensor.data_ptr() == out.data_ptr() and tensor.shape == out.shape and tensor.dtype == out.dtype:
        return out
    out.copy_(tensor)
    return out
