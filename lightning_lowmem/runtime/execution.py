"""The execution plan: how each layer runs, decided once from the placement, and read by the load, the streamer and
the estimate.

::

    ExecutionPlan.of(plan, placement, device)
        per layer: its tier (resident on the execution device; "cpu": kept on the host, copied in for its forward;
        "disk": read from the checkpoint file for each forward), its compute device, its floating dtype as stored
        and as computed, its bytes, the bytes read from the file per forward, and whether it is tied modules (read
        once per forward, kept from the first of them to the last)
        bf16 -> fp16 per compute device: a layer kept on the CPU or on disk computes on the execution device, so a
        GPU without bf16 gives it fp16 like the layers resident there (the device that stores it does not decide)
    .apply(plan)        the load's targets get the dtype they compute in (one warning per device that falls back)
    .read_nbytes, .buffer_nbytes   per forward: what the disk tier reads, and the host buffers it reads into: the
                        placement's numbers, which the estimate and the placement table print

Without a placement every tensor computes where it is loaded (``device=``, or where the module holds it).

This module is the one owner of where and how a layer runs; every face asks it (``request/defaults.py`` turns a
load's options into its questions):

::

    execution_device(budget_device, device, default)   where a load computes: max_memory's execution device, else
                                                       ``device``, else the face's default
    default_device()                                   litgpt's default: CUDA when there is one, else the CPU
    compute_dtype(dtype, device)                       ``dtype``, but fp16 for bf16 where ``device`` lacks bf16
    path_device(plan)                                  the device whose tensors a load copies through a copy engine
    forward_device(model)                              where a model's forward computes: its streamers' device
                                                       (layers offloaded or on disk), else its first parameter's
    collective_device(group) / mesh_device(mesh)       this rank's device for a collective, or for a DTensor's
                                                       shards: the one its process group is bound to, else
                                                       ``LOCAL_RANK``'s, else the only one; never the current
                                                       device (a script that never set it has every rank on device 0)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from lightning_lowmem.dtypes import fallback_dtype
from lightning_lowmem.runtime.guard import streamers_in
from lightning_lowmem.runtime.rank_device import collective_device, device_index, device_type_for, mesh_device
from lightning_lowmem.transfer import ENGINES
from lightning_lowmem.memory import format_bytes
from lightning_lowmem.placement import DISK, Layer, PlacementPlan
from lightning_lowmem.plan import LoadPlan, Target

Tier = Literal["resident", "cpu", "disk"]


@dataclass(frozen=True)
class LayerRun:
    """How one layer of the placement runs.

    Attributes:
        name: the layer's name (``'lm_head+transformer.wte'`` for tied modules).
        modules: its module names.
        tensors: every name of its tensors (tied names included).
        tier: ``"resident"`` (on the execution device), ``"cpu"`` (masters on the host, copied in for its forward)
            or ``"disk"`` (read from the checkpoint file for each forward).
        compute_device: where it computes (the execution device, whatever its tier).
        storage_dtype: the floating dtype its tensors are kept in (on disk: the file's), or None (none floating).
        compute_dtype: the floating dtype it computes in (after the bf16 -> fp16 fallback of its compute device).
        nbytes: its bytes on the device (target dtype, quantized where the load quantizes).
        read_nbytes: bytes read from the checkpoint file per forward (0 unless on disk; tied modules: once).
        tied: modules joined by a tie (an embedding and its head): a streamed copy is kept for the whole forward.
    """

    name: str
    modules: tuple[str, ...]
    tensors: tuple[str, ...]
    tier: Tier
    compute_device: torch.device
    storage_dtype: torch.dtype | None
    compute_dtype: torch.dtype | None
    nbytes: int
    read_nbytes: int
    tied: bool


@dataclass
class ExecutionPlan:
    """How the layers of a load run. ``str(plan)`` is a table.

    Attributes:
        device: the execution device.
        layers: each layer of the placement, in module order (empty without a placement).
        placement: the placement it was made from, or None.
        fallback: compute device -> the dtype bf16 tensors get there, for each device without bf16.
    """

    device: torch.device
    layers: list[LayerRun] = field(default_factory=list)
    placement: PlacementPlan | None = None
    fallback: dict[str, torch.dtype] = field(default_factory=dict)
    _compute: dict[str, torch.device] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, plan: LoadPlan, placement: PlacementPlan | None, device: torch.device | str) -> ExecutionPlan:
        """The execution plan of ``plan`` placed by ``placement`` (None: every tensor computes where it is loaded)
        with ``device`` the execution device.

        Example::

            >>> from lightning_lowmem.placement import Layer
            >>> layers = [Layer("h.0", ["h.0"], ["h.0.w"], nbytes=8, device="cuda:0"),
            ...           Layer("h.1", ["h.1"], ["h.1.w"], nbytes=8, device="cpu")]
            >>> placement = PlacementPlan(layers, {"cuda:0": 100, "cpu": 100}, "cuda:0", "cpu")
            >>> ExecutionPlan.of(LoadPlan([]), placement, "cuda:0").tiers()
            {'h.0': 'resident', 'h.1': 'cpu'}
        """
        execution = cls(torch.device(device), placement=placement)
        if placement is not None:
            execution.device = torch.device(placement.execution_device)
            execution._compute = {name: execution.device for layer in placement.layers for name in layer.tensors}
        for target in plan.targets:
            key = str(execution.compute_device(target))
            if key not in execution.fallback and target.dtype == torch.bfloat16 and target.shard is None:
                execution.fallback[key] = fallback_dtype(torch.bfloat16, key, warn=False)
        execution.fallback = {d: t for d, t in execution.fallback.items() if t != torch.bfloat16}
        if placement is not None:
            by_name = {t.names[0]: t for t in plan.targets}
            execution.layers = [execution._run(layer, [by_name[n] for n in layer.tensors if n in by_name])
                                for layer in placement.layers]
        return execution

    def compute_device(self, target: Target) -> torch.device:
        """Where ``target`` computes: the execution device for every layer of a placement, else where it is loaded."""
        return self._compute.get(target.names[0], target.device)

    def compute_dtype(self, target: Target) -> torch.dtype:
        """The dtype ``target`` computes in: its own, but bf16 where its compute device lacks bf16 (a DTensor shard
        keeps its DTensor's dtype)."""
        if target.dtype != torch.bfloat16 or target.shard is not None:
            return target.dtype
        return self.fallback.get(str(self.compute_device(target)), target.dtype)

    def apply(self, plan: LoadPlan) -> dict[str, torch.dtype]:
        """Give each target of ``plan`` the dtype it computes in, warning once per compute device that falls back.

        Returns:
            Compute device -> the dtype bf16 tensors get there, for each device that fell back.
        """
        for device in self.fallback:
            fallback_dtype(torch.bfloat16, device)  # the warning, once per device
        for target in plan.targets:
            target.dtype = self.compute_dtype(target)
        return dict(self.fallback)

    def tiers(self) -> dict[str, Tier]:
        """Layer name -> its tier."""
        return {layer.name: layer.tier for layer in self.layers}

    @property
    def offloaded(self) -> list[LayerRun]:
        """The layers kept on the host and copied to the execution device for their forward."""
        return [layer for layer in self.layers if layer.tier == "cpu"]

    @property
    def on_disk(self) -> list[LayerRun]:
        """The layers read from the checkpoint file for each forward."""
        return [layer for layer in self.layers if layer.tier == "disk"]

    @property
    def read_nbytes(self) -> int:
        """Bytes read from the checkpoint file for each forward: every layer on disk once (the placement's count)."""
        return self.placement.disk_read_bytes if self.placement is not None else 0

    @property
    def buffer_nbytes(self) -> int:
        """Host memory the layers on disk are read into (the placement's count)."""
        return self.placement.disk_buffer_bytes if self.placement is not None else 0

    def _run(self, layer: Layer, targets: list[Target]) -> LayerRun:
        placement = self.placement
        tier: Tier = "disk" if layer.device == DISK else "cpu" if layer.device == placement.offload_device \
            and layer.device != placement.execution_device else "resident"
        computed = _floating(targets, lambda t: (self.compute_dtype(t), t.cast_nbytes))
        stored = _floating(targets, lambda t: (t.record.dtype, t.read_nbytes)) if tier == "disk" else computed
        return LayerRun(layer.name, tuple(layer.modules), tuple(layer.tensors), tier, self.device, stored, computed,
                        layer.nbytes, layer.read_nbytes if tier == "disk" else 0, layer.tied)

    def __str__(self) -> str:
        lines = [f"Execution plan: layers compute on {self.device}"
                 + "".join(f"; bf16 -> {str(t).removeprefix('torch.')} on {d}" for d, t in self.fallback.items())]
        for layer in self.layers:
            dtypes = " -> ".join(dict.fromkeys(str(d).removeprefix("torch.") for d in
                                               (layer.storage_dtype, layer.compute_dtype) if d is not None))
            read = f", {format_bytes(layer.read_nbytes)} read per forward" if layer.read_nbytes else ""
            lines.append(f"  {layer.name:<34}{layer.tier:>9}  {dtypes or '-'}{read}")
        return "\n".join(lines)


def _floating(targets: list[Target], of: Callable[[Target], tuple[torch.dtype, int]]) -> torch.dtype | None:
    """The floating dtype most of ``targets``' bytes are in, ``of(target) -> (dtype, bytes)``; None when none is."""
    weights: Counter[torch.dtype] = Counter()
    for target in targets:
        dtype, nbytes = of(target)
        if dtype.is_floating_point:
            weights[dtype] += nbytes
    return max(weights, key=weights.__getitem__) if weights else None


def execution_device(budget_device: str | None, device: torch.device | None,
                     default: torch.device | str | None = None) -> torch.device | None:
    """Where a load computes: ``budget_device`` (``max_memory``'s execution device: offloaded and on-disk layers are
    brought there for their forward), else ``device``, else ``default`` (None: each tensor where the module holds it).

    Example::

        >>> execution_device("cuda:0", None), execution_device(None, None, "cpu"), execution_device(None, None)
        (device(type='cuda', index=0), device(type='cpu'), None)
    """
    if budget_device is not None:
        return torch.device(budget_device)
    if device is not None:
        return torch.device(device)
    return torch.device(default) if default is not None else None


def default_device() -> torch.device:
    """litgpt's default device: ``cuda`` when this machine has one, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def compute_dtype(dtype: torch.dtype | None, device: torch.device | str) -> torch.dtype | None:
    """The floating dtype a tensor of ``dtype`` computes in on ``device``: fp16 for bf16 where ``device`` lacks bf16
    (the rule :meth:`ExecutionPlan.compute_dtype` applies to each layer); None stays None."""
    return None if dtype is None else fallback_dtype(dtype, device, warn=False)


def forward_device(model: nn.Module) -> torch.device | None:
    """Where ``model``'s forward computes, for its inputs and its caches: the device its streamers bring their layers
    to (layers offloaded to the CPU or read from disk: their masters are elsewhere, the first of them is often the
    input embedding), else the device of its first parameter not on meta (the input embedding, for the models the
    faces run), else None (no parameters, or only meta ones)."""
    for streamer in streamers_in(model):
        return torch.device(streamer.device)
    return next((p.device for p in model.parameters() if not p.is_meta), None)


def path_device(plan: LoadPlan) -> torch.device | None:
    """The device whose tensors take a load's device path: the first one of ``plan`` with a copy engine
    (``transfer.ENGINES``: CUDA), or None."""
    return next((t.device for t in plan.targets if t.device.type in ENGINES), None)


__all__ = ["ExecutionPlan", "LayerRun", "Tier", "collective_device", "compute_dtype", "default_device",
           "device_index", "device_type_for", "execution_device", "forward_device", "mesh_device", "path_device"]
