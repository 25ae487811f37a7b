"""The host as a source (``source.py``): each module's tensors kept on the host (the masters), copied to the device
for its forward and dropped after.

The CPU copy is the master: device copies are temporary, so in-place changes made on the device are not kept (this
is for inference). Masters are pinned where CUDA is the target, so copies are asynchronous. Parameters and
persistent buffers are offloaded; non-persistent buffers (KV caches, masks) stay where they are, since they carry
state across forwards. A tensor two modules share (a tied embedding and head) has one master.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lightning_lowmem.quantize import tensor_nbytes
from lightning_lowmem.runtime.source import Fetched, Source


class Weights:
    """The offloaded tensors of one module: masters on the host, copies on the device while it runs.

    Args:
        module: the module.
        host: where the masters live.
        pin: pin them.
        masters: id of a tensor -> its master, shared by every module of a source (one master per tied tensor).
    """

    def __init__(self, module: nn.Module, host: torch.device, pin: bool,
                 masters: dict[int, torch.Tensor] | None = None) -> None:
        self.params: list[nn.Parameter] = []
        self.buffers: list[list[tuple[nn.Module, str]]] = []
        seen: dict[int, int] = {}
        for mod in module.modules():
            for p in mod._parameters.values():
                if p is not None and id(p) not in seen:
                    seen[id(p)] = len(self.params)
                    self.params.append(p)
            for leaf, b in mod._buffers.items():
                if b is None or leaf in mod._non_persistent_buffers_set:
                    continue
                if id(b) not in seen:
                    seen[id(b)] = -1 - len(self.buffers)
                    self.buffers.append([])
                self.buffers[-1 - seen[id(b)]].append((mod, leaf))
        shared = {} if masters is None else masters
        keys = [id(p) for p in self.params] + [id(slots[0][0]._buffers[slots[0][1]]) for slots in self.buffers]
        tensors = [p.data for p in self.params] + [slots[0][0]._buffers[slots[0][1]] for slots in self.buffers]
        self.masters: list[torch.Tensor] = []
        for key, t in zip(keys, tensors):
            if key not in shared:
                master = t.detach().to(host)
                shared[key] = master.pin_memory() if pin and not master.is_pinned() else master
            self.masters.append(shared[key])
        self.install(self.masters)
        self.nbytes = nbytes(self.masters)

    def copy_to(self, device: torch.device) -> list[torch.Tensor]:
        """Fresh copies of the masters on ``device`` (asynchronous from pinned memory)."""
        return [m.to(device, non_blocking=True, copy=True) for m in self.masters]

    def install(self, tensors: list[torch.Tensor]) -> None:
        """Point the module's parameters and buffers at ``tensors`` (copies, or the masters)."""
        for p, t in zip(self.params, tensors):
            p.data = t  # the Parameter object stays: ties and references to it still hold
        for slots, t in zip(self.buffers, tensors[len(self.params):]):
            for owner, leaf in slots:
                owner._buffers[leaf] = t


def nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes ``tensors`` hold, each storage once: a quantized tensor's inner tensors, not numel x its outer dtype
    (a torchao int8 weight shows as bf16, twice its bytes)."""
    seen: set[tuple[str, int]] = set()
    return sum(tensor_nbytes(t, seen) for t in tensors)


class HostCopies(Source):
    """Masters on ``host`` for each of ``modules``, copied to ``device`` for its forward.

    Args:
        modules: name -> module.
        device: the execution device.
        host: where the masters live.
        pin: pin the masters.
    """

    def __init__(self, modules: Mapping[str, nn.Module], device: torch.device, host: torch.device, pin: bool) -> None:
        self.device = device
        masters: dict[int, torch.Tensor] = {}
        self.weights = {name: Weights(module, host, pin, masters) for name, module in modules.items()}
        self.nbytes = nbytes(list(masters.values()))

    def fetch(self, name: str, claim: object, stream: torch.cuda.Stream | None) -> Fetched:
        if stream is None:
            return Fetched(name, self.weights[name].copy_to(self.device))
        with torch.cuda.stream(stream):
            tensors = self.weights[name].copy_to(self.device)
            event = torch.cuda.Event()
            event.record(stream)
        return Fetched(name, tensors, event)

    def install(self, name: str, fetched: Fetched) -> None:
        self.weights[name].install(fetched.tensors)

    def release(self, name: str, fetched: Fetched) -> None:
        self.weights[name].install(self.weights[name].masters)  # the device copy is dropped here
