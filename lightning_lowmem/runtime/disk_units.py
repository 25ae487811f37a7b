"""The layers the disk tier reads for each forward (``file_reads.py``): what each holds between forwards, where its
tensors go in a read buffer, and how they are put in and taken out.

::

    check_streamable(plan, placement)   before any read: nothing on disk would be quantized for every forward
    DiskUnit.of(root, name, modules, targets)
                                        a layer on disk (one module, or tied modules): its targets, their slots in a
                                        buffer
        .place(root)                    placeholders in (one element each, expanded: no memory), remembered
        .install(root, tensors, device) its tensors pointed at what was read (a weight stored quantized: its layout)
        .release()                      the placeholders back, and every attribute the install changed
        .unplace(root, advice)          back on meta, for good (the tier was closed)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_lowmem.errors import UnsupportedQuantizationError, format_names
from lightning_lowmem.meta import assign, check_meta_at_first_forward, owner_of
from lightning_lowmem.placement import PlacementPlan
from lightning_lowmem.plan import LoadPlan, Target
from lightning_lowmem.quantize.layouts import layout_of
from lightning_lowmem.runtime.layer_buffers import Slot, lay_out

_ABSENT = object()


def check_streamable(plan: LoadPlan, placement: PlacementPlan, files: str) -> None:
    """Refuse, before any read, a disk tier that would quantize weights for every forward, or hold DTensor shards.

    Quantizing as read costs about as much as the read itself for each weight (bitsandbytes nf4 on a CPU: far
    more), for every token: a file quantized once and streamed reads 4x fewer bytes (nf4) and quantizes nothing.

    Raises:
        UnsupportedQuantizationError: weights on disk would be quantized as read (``quantize=`` on a full-precision
            file): quantize once and stream the quantized copy instead.
        ValueError: a target on disk is a DTensor shard.
    """
    on_disk = [t for t in plan.targets if placement.is_on_disk(t.names[0])]
    if any(t.shard is not None for t in on_disk):
        raise ValueError("disk_offload=True cannot hold DTensor shards (a model sharded across ranks): give each rank "
                         "budgets that hold its shards, or load without disk_offload.")
    quantized = [t for t in on_disk if t.scheme is not None and t.stored is None]
    if quantized:
        scheme = quantized[0].scheme.name
        raise UnsupportedQuantizationError(
            f"disk_offload=True reads {len(placement.on_disk)} layers from {files} for every forward, and "
            f"{len(quantized)} of their weights ({format_names([t.names[0] for t in quantized], 3)}) would be "
            f"quantized to {scheme} as they are read, again for each token. Quantize once, then stream the quantized "
            f"copy: `lightning-lowmem quantize <checkpoint> --quantize {scheme} --out <dir>` (or load with quantize= "
            "and save_checkpoint), and load <dir> with disk_offload=True. Or drop quantize=, or raise max_memory so "
            "that the quantized layers stay in memory. Nothing was read.")


def placeholder(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``shape`` and ``dtype`` that holds one element (zero), expanded: it takes no memory.

    Example::

        >>> t = placeholder((4096, 4096), torch.bfloat16)
        >>> t.shape, t.untyped_storage().nbytes()
        (torch.Size([4096, 4096]), 2)
    """
    return torch.zeros((), dtype=dtype).expand(shape)


@dataclass
class DiskUnit:
    """One layer read from disk: its modules (several when tied: an embedding and the head that shares its weight),
    its targets, where each of its tensors lies in a read buffer.

    Attributes:
        name: the layer's name in the placement (``'lm_head+transformer.wte'`` for tied modules).
        modules: the names of its modules.
        targets: the plan's targets of its tensors (a tensor its modules share: one target, read once).
        slots: where each target's tensors go in a buffer (a weight stored quantized: one slot per part).
        nbytes: the bytes its slots span.
        owners: the modules its install touches: its own, and the owners of names it ties elsewhere.
    """

    name: str
    modules: list[str]
    targets: list[Target]
    slots: list[list[Slot]]
    nbytes: int
    owners: list[nn.Module] = field(default_factory=list)
    _homes: list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _changed: list[tuple[nn.Module, str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, name: str, modules: list[str], targets: list[Target]) -> DiskUnit:
        """The layer ``name`` of modules ``modules`` and its ``targets``, laid out in a buffer."""
        specs = [_specs(target) for target in targets]
        layout, nbytes = lay_out(spec for target_specs in specs for spec in target_specs)
        slots, at = [], 0
        for target_specs in specs:
            slots.append(layout[at:at + len(target_specs)])
            at += len(target_specs)
        return cls(name, list(modules), targets, slots, nbytes)

    @property
    def read_nbytes(self) -> int:
        """Bytes read from the checkpoint for one read of the layer (each tensor once, tied ones too)."""
        return sum(target.read_nbytes for target in self.targets)

    @property
    def held(self) -> bool:
        """Whether its modules run apart (tied modules): read once per forward, kept until the last of them ran."""
        return len(self.modules) > 1

    def place(self, root: nn.Module) -> None:
        """Placeholders for its tensors (frozen: they are read, never trained), remembered for :meth:`release`.

        Only these entries are put back after each forward: what else its modules gain meanwhile (a KV cache
        module, set up after the load) stays.
        """
        for target in self.targets:
            assign(root, target.names, placeholder(*_home_spec(target)), target.is_parameter)
            for name in target.names:
                owner, leaf = owner_of(root, name)
                table = owner._parameters if target.is_parameter else owner._buffers
                home = table[leaf]
                if target.is_parameter:
                    home.requires_grad_(False)
                self._homes.append((table, leaf, home, home.data))
        inside = {id(m): m for name in self.modules for m in root.get_submodule(name).modules()}
        outside = {id(m): m for t in self.targets for n in t.names for m in [owner_of(root, n)[0]]
                   if id(m) not in inside}
        self.owners = [*inside.values(), *outside.values()]

    def install(self, root: nn.Module, tensors: list[Any], device: torch.device) -> None:
        """Point its tensors at ``tensors`` (one per target, as read: a tensor, or a stored weight's parts by key); note
        every attribute that changes (a bitsandbytes quant state) to undo it in :meth:`release`."""
        before = [(m, dict(m.__dict__)) for m in self.owners]
        for target, tensor in zip(self.targets, tensors):
            if isinstance(tensor, dict):  # a weight stored quantized: its parts, by checkpoint key
                owner = root.get_submodule(target.names[0].rpartition(".")[0])
                roles = {role: tensor[rec.key] for role, rec in target.stored.roles.items()}
                layout_of(target.scheme).load_stored(owner, target.stored, roles, device)
            else:
                assign(root, target.names, tensor, target.is_parameter)
        self._changed = [(m, key, old.get(key, _ABSENT)) for m, old in before for key, value in m.__dict__.items()
                         if old.get(key, _ABSENT) is not value]

    def release(self) -> None:
        """The placeholders back, and every attribute the install changed."""
        for table, leaf, home, data in self._homes:
            table[leaf] = home
            home.data = data  # an install may have pointed the placeholder itself at the data read
        for module, key, old in self._changed:
            if old is _ABSENT:
                module.__dict__.pop(key, None)
            else:
                module.__dict__[key] = old
        self._changed = []

    def unplace(self, root: nn.Module, advice: str) -> None:
        """Its tensors back on meta for good; its modules' next forward raises a ``MetaTensorError`` saying ``advice``."""
        for target in self.targets:
            shape, dtype = _home_spec(target)
            assign(root, target.names, torch.empty(shape, dtype=dtype, device="meta"), target.is_parameter)
        for name in self.modules:
            check_meta_at_first_forward(root.get_submodule(name), advice)


def _specs(target: Target) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The tensors ``target`` is held as while its module runs: its parts for a weight stored quantized, else itself."""
    if target.stored is not None:
        return [(tuple(p.shape), p.dtype) for p in target.parts]
    return [(tuple(target.record.shape), target.dtype)]


def _home_spec(target: Target) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype of a target's placeholder: the tensor as the module declares it."""
    return tuple(target.record.shape), target.dtype
