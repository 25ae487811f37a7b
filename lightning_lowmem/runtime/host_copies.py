"""The host as a source (``source.py``): each module's tensors kept on the host (the masters), copied to the device
for its forward and dropped after.

A tensor moves whole (``quantize/moves.py``): every plain tensor its module's forward reads through it (a torchao
weight's inner tensors, a bitsandbytes weight's quant state or int8 row scales) has a master, and for each forward a
copy on the device, around which the weight is rebuilt; the forward reads no master. The masters of a layer are
carved from one block of host memory (``transfer/pinned.py``: pinned for a CUDA device, whole pages, the bytes the
placement counts for that layer on the CPU); copies are made through the streamer's copy engine
(``transfer/copies.py``: a side stream for CUDA).

The CPU copy is the master: device copies are temporary, so in-place changes made on the device are not kept (this
is for inference). Parameters and persistent buffers are offloaded; non-persistent buffers (KV caches, masks) stay
where they are, since they carry state across forwards. A tensor two modules share (a tied embedding and head) has
one master. A plain Parameter keeps its object (its ``.data`` is swapped); a quantized weight is rebuilt, and the
rebuilt object takes its place in its modules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from lightning_lowmem.quantize.moves import Kind, kind_of
from lightning_lowmem.runtime.source import Fetched, Source
from lightning_lowmem.transfer import CopyEngine, HostPool, lay_out
from lightning_lowmem.transfer.copies import InlineCopies
from lightning_lowmem.transfer.pinned import carve


class Entry:
    """One tensor the offloaded modules hold: the places it sits in (``slots``), how it moves, its master.

    Attributes:
        tensor: the tensor as the module held it (a plain Parameter keeps this object).
        kind: how it moves.
        slots: ``(module, name)`` of each place it sits in (its parameters or buffers table).
        is_param: a parameter (else a persistent buffer).
        master: the tensor rebuilt around the host parts (the part itself for a plain tensor).
        parts: name -> its master part on the host.
    """

    def __init__(self, tensor: torch.Tensor, is_param: bool) -> None:
        self.tensor, self.is_param, self.kind = tensor, is_param, kind_of(tensor)
        self.slots: list[tuple[nn.Module, str]] = []
        self.master: torch.Tensor | None = None
        self.parts: dict[str, torch.Tensor] = {}

    @property
    def owners(self) -> list[nn.Module]:
        return list({id(m): m for m, _ in self.slots}.values())

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts.values())

    def install(self, built: torch.Tensor) -> None:
        """Put ``built`` (a copy of the master on the device, or the master) where the tensor sits."""
        if self.kind.keeps_object and self.is_param:
            self.tensor.data = built  # the Parameter object stays: ties and references to it still hold
        else:
            for owner, leaf in self.slots:
                (owner._parameters if self.is_param else owner._buffers)[leaf] = built
        for owner in self.owners:
            self.kind.attach(owner, built)


def _entries(modules: Sequence[nn.Module], shared: dict[int, Entry]) -> list[Entry]:
    """The parameters and persistent buffers of ``modules``, each tensor once (``shared`` across a source: one entry
    per tied tensor)."""
    entries: dict[int, Entry] = {}
    for module in modules:
        for mod in module.modules():
            held = [(leaf, t, True) for leaf, t in mod._parameters.items()] + [
                (leaf, t, False) for leaf, t in mod._buffers.items() if leaf not in mod._non_persistent_buffers_set]
            for leaf, tensor, is_param in held:
                if tensor is None:
                    continue
                entry = shared.setdefault(id(tensor), Entry(tensor, is_param))
                if (mod, leaf) not in entry.slots:
                    entry.slots.append((mod, leaf))
                entries.setdefault(id(tensor), entry)
    return list(entries.values())


def _masters(entries: list[Entry], pool: HostPool) -> None:
    """The masters of ``entries``, their parts carved from one block of ``pool`` and copied there."""
    parts = [(entry, name, part) for entry in entries
             for name, part in entry.kind.parts(entry.tensor, entry.owners).items()]
    offsets, total = lay_out(part.numel() * part.element_size() for _, _, part in parts)
    block = pool.block(total) if parts else None
    for (entry, name, part), offset in zip(parts, offsets):
        entry.parts[name] = carve(block, offset, tuple(part.shape), part.dtype).copy_(part)
    for entry in entries:
        entry.master = entry.kind.build(entry.tensor, entry.parts)


class Weights:
    """The offloaded tensors of one module: masters on the host, copies on the device while it runs.

    Attributes:
        entries: its tensors (a tensor it shares with another module of the source: the same entry).
        masters: the master of each.
        nbytes: bytes of its masters' parts.
    """

    def __init__(self, module: nn.Module, shared: dict[int, Entry]) -> None:
        self.entries = _entries([module], shared)

    @property
    def masters(self) -> list[torch.Tensor]:
        return [entry.master for entry in self.entries]

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries)

    def copy_to(self, engine: CopyEngine) -> tuple[list[dict[str, torch.Tensor]], object]:
        """Copies of every master part on ``engine``'s device, and the fence of the last copy (None: done)."""
        fence, copies = None, []
        for entry in self.entries:
            moved = {}
            for name, part in entry.parts.items():
                moved[name] = engine.empty(tuple(part.shape), part.dtype)
                fence = engine.copy(moved[name], part) or fence
            copies.append(moved)
        return copies, fence

    def install(self, copies: list[dict[str, torch.Tensor]]) -> None:
        """Point the module's tensors at ``copies`` (each entry rebuilt around its parts on the device)."""
        for entry, parts in zip(self.entries, copies):
            entry.install(entry.kind.build(entry.master, parts))

    def restore(self) -> None:
        """Point the module's tensors back at the masters."""
        for entry in self.entries:
            entry.install(entry.master)


class HostCopies(Source):
    """Masters on the host for each of ``modules``, copied to ``device`` for its forward.

    Args:
        modules: name -> module.
        device: the execution device.
        host: where the masters live (the CPU).
        pin: pin the masters.
        groups: the module names whose masters share one block of host memory (a placement's layers: a tied
            embedding and head together); default: each module alone.
    """

    def __init__(self, modules: Mapping[str, nn.Module], device: torch.device, host: torch.device, pin: bool,
                 groups: Sequence[Sequence[str]] | None = None) -> None:
        if host.type != "cpu":
            raise ValueError(f"Offloaded masters live on the CPU; host={host} is not one.")
        self.device = device
        self.pool = HostPool(device, pin=pin)
        self._inline = InlineCopies(device)  # the copies without an engine (the CPU): made at once
        shared: dict[int, Entry] = {}
        self.weights = {name: Weights(module, shared) for name, module in modules.items()}
        placed: set[int] = set()
        for group in groups if groups is not None else [[name] for name in modules]:
            fresh = {id(e): e for name in group for e in self.weights[name].entries if id(e) not in placed}
            placed |= fresh.keys()
            _masters(list(fresh.values()), self.pool)
        for weights in self.weights.values():
            weights.restore()
        self._entries = list(shared.values())

    @property
    def nbytes(self) -> int:
        """Bytes of the masters' parts (a tensor several modules share, once)."""
        return sum(entry.nbytes for entry in self._entries)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of host memory the masters take: the pool's blocks (whole pages, pinned for CUDA)."""
        return self.pool.nbytes

    def fetch(self, name: str, claim: object, engine: CopyEngine | None) -> Fetched:
        tensors, fence = self.weights[name].copy_to(engine or self._inline)
        return Fetched(name, tensors, fence)

    def install(self, name: str, fetched: Fetched) -> None:
        self.weights[name].install(fetched.tensors)

    def release(self, name: str, fetched: Fetched) -> None:
        self.weights[name].restore()  # the device copies are dropped here

