"""Offloading: weights live on the CPU and visit the execution device only for their own forward.

Two modes, one mechanism (forward pre/post hooks on the offloaded modules):

* ``"sequential"``: whole submodules (a text encoder that runs once per prompt)
  are copied to the device before their forward and dropped after, as
  accelerate's ``cpu_offload`` does.
* ``"layers"``: each transformer block is copied in for its forward while the
  next one is already being copied on a side CUDA stream, so the transfer
  overlaps the compute. The order is learned from the forward itself.

The CPU copy is the master: the device copies are temporary and dropped after
each forward (no second copy stays on the device), so in-place changes made
on the device are not kept: this is for inference. Masters are pinned where
CUDA is the target, so copies are asynchronous. Parameters and persistent
buffers are offloaded; non-persistent buffers (KV caches, masks) stay where
they are, since they carry state across forwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_lowmem.placement.layers import find_blocks
from lightning_lowmem.placement.place import PlacementPlan
from lightning_lowmem.quantize import tensor_nbytes


class _Weights:
    """The offloaded tensors of one module: masters on the host, copies on the device while it runs."""

    def __init__(self, module: nn.Module, host: torch.device, pin: bool) -> None:
        self.params: list[nn.Parameter] = []
        self.buffers: list[list[tuple[nn.Module, str]]] = []
        self.masters: list[torch.Tensor] = []
        seen: dict[int, int] = {}
        for mod in module.modules():
            for leaf, p in mod._parameters.items():
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
        tensors = [p.data for p in self.params] + [slots[0][0]._buffers[slots[0][1]] for slots in self.buffers]
        for t in tensors:
            master = t.detach().to(host)
            self.masters.append(master.pin_memory() if pin and not master.is_pinned() else master)
        self.install(self.masters)
        self.nbytes = _nbytes(self.masters)

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


def _nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes ``tensors`` hold, each storage once: a quantized tensor's inner tensors, not numel x its outer dtype
    (a torchao int8 weight shows as bf16, twice its bytes)."""
    seen: set[tuple[str, int]] = set()
    return sum(tensor_nbytes(t, seen) for t in tensors)


@dataclass
class OffloadStats:
    """What the hooks did. ``resident_bytes`` is 0 between forwards: no copy is kept on the device."""

    fetches: int = 0
    prefetch_hits: int = 0
    resident_bytes: int = 0
    max_resident_bytes: int = 0


@dataclass
class _Copy:
    name: str
    tensors: list[torch.Tensor]
    event: torch.cuda.Event | None = None


class Offload:
    """Hooks that copy the weights of ``modules`` to ``device`` for their forward and drop them after.

    Build it with :func:`enable_offload` or :func:`dispatch`; :meth:`remove` takes the hooks
    off and leaves the masters in place (on the host).

    Args:
        root: the model whose forward runs the modules; its hooks reset the state of each forward.
        modules: name -> module to offload, in the order they are expected to run.
        device: the execution device.
        host: where the masters live.
        prefetch: copy the next module while the current one computes.
        pin: pin the masters (default: when ``device`` is CUDA).
    """

    def __init__(self, root: nn.Module | None, modules: Mapping[str, nn.Module], device: torch.device | str, *,
                 host: torch.device | str = "cpu", prefetch: bool = True, pin: bool | None = None) -> None:
        self.device = torch.device(device)
        pin = self.device.type == "cuda" and torch.cuda.is_available() if pin is None else pin
        self.modules = dict(modules)
        self.weights = {name: _Weights(mod, torch.device(host), pin) for name, mod in modules.items()}
        self.prefetch = prefetch
        self.stats = OffloadStats()
        names = list(modules)
        self._next: dict[str, str] = dict(zip(names, names[1:]))
        self._prev: str | None = None
        self._active: dict[str, _Copy] = {}
        self._pending: _Copy | None = None
        self._stream = torch.cuda.Stream(self.device) if prefetch and self.device.type == "cuda" else None
        self._handles: list[RemovableHandle] = []
        for name, mod in modules.items():
            self._handles.append(mod.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._handles.append(mod.register_forward_hook(self._post_hook(name), always_call=True))
        if root is not None and root not in modules.values():
            self._handles.append(root.register_forward_pre_hook(lambda *_: self._reset()))
            self._handles.append(root.register_forward_hook(lambda *_: self._end(), always_call=True))

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of the masters kept on the host."""
        return sum(w.nbytes for w in self.weights.values())

    def remove(self) -> None:
        """Take the hooks off; every offloaded tensor is its master again."""
        self._reset()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_hook(self, name: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if self._prev is not None:
                self._next[self._prev] = name  # learn the order the forward really takes
            self._prev = name
            copy = self._take(name)
            self.weights[name].install(copy.tensors)
            self._active[name] = copy
            following = self._next.get(name)
            if self.prefetch and following is not None and following not in self._active:
                self._pending = self._fetch(following, self._stream)
            self._account()
            return (apply_to_collection(args, torch.Tensor, self._to_device),
                    apply_to_collection(kwargs, torch.Tensor, self._to_device))
        return hook

    def _post_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.weights[name].install(self.weights[name].masters)
            self._active.pop(name, None)  # the device copy is dropped here
            self._account()
        return hook

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def _fetch(self, name: str, stream: torch.cuda.Stream | None) -> _Copy:
        self.stats.fetches += 1
        if stream is None:
            return _Copy(name, self.weights[name].copy_to(self.device))
        with torch.cuda.stream(stream):
            tensors = self.weights[name].copy_to(self.device)
            event = torch.cuda.Event()
            event.record(stream)
        return _Copy(name, tensors, event)

    def _take(self, name: str) -> _Copy:
        """The copy of ``name``: the prefetched one when the guess was right, else a copy made now."""
        pending, self._pending = self._pending, None
        if pending is None or pending.name != name:
            return self._fetch(name, None)  # on the current stream: ordered before the forward
        self.stats.prefetch_hits += 1
        if pending.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(pending.event)
            for t in pending.tensors:
                t.record_stream(current)  # made on the side stream, used on this one
        return pending

    def _account(self) -> None:
        copies = list(self._active.values()) + ([self._pending] if self._pending is not None else [])
        resident = _nbytes([t for c in copies for t in c.tensors])
        self.stats.resident_bytes = resident
        self.stats.max_resident_bytes = max(self.stats.max_resident_bytes, resident)

    def _reset(self) -> None:
        """Start of a forward: nothing left over from one that failed half way."""
        for name in list(self._active):
            self.weights[name].install(self.weights[name].masters)
        self._active.clear()
        self._pending = None
        self._prev = None
        self._account()

    def _end(self) -> None:
        """End of a forward: the last module has no successor; drop any copy still in flight."""
        if self._prev is not None:
            self._next.pop(self._prev, None)
        self._reset()


def sequential_offload(module: nn.Module, device: torch.device | str, *, host: torch.device | str = "cpu",
                       pin: bool | None = None) -> Offload:
    """Keep ``module`` on the host; copy it to ``device`` for each of its forwards, drop the copy after.

    Its inputs are moved to ``device``; its outputs stay there (like accelerate's ``cpu_offload``).

    Example::

        >>> encoder = nn.Linear(8, 8)
        >>> handle = sequential_offload(encoder, "cpu")  # "cuda" on a GPU machine: on the device for its forward only
        >>> encoder(torch.ones(1, 8)).shape, handle.stats.fetches
        (torch.Size([1, 8]), 1)
        >>> handle.remove()
    """
    return Offload(None, {"": module}, device, host=host, prefetch=False, pin=pin)


def layer_offload(model: nn.Module, device: torch.device | str, *, layers: list[str] | None = None,
                  host: torch.device | str = "cpu", prefetch: bool = True, pin: bool | None = None) -> Offload:
    """Keep the ``layers`` of ``model`` on the host, each copied to ``device`` for its forward.

    Args:
        model: the model; the rest of it must already be on ``device``.
        device: the execution device.
        layers: module names to offload; default: the children of the first ``nn.ModuleList``.
        host: where the masters live.
        prefetch: copy the next layer on a side stream while the current one computes.
        pin: pin the masters (default: when ``device`` is CUDA).
    """
    if layers is None:
        blocks = find_blocks(model)
        if blocks is None:
            raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks: pass layers= (module names).")
        layers = [f"{blocks}.{i}" if blocks else str(i) for i in range(len(model.get_submodule(blocks)))]
    modules = {name: model.get_submodule(name) for name in layers}
    return Offload(model, modules, device, host=host, prefetch=prefetch, pin=pin)


def dispatch(model: nn.Module, placement: PlacementPlan, *, device: torch.device | str | None = None,
             prefetch: bool | None = None) -> Offload | None:
    """Layer offload for the layers ``placement`` put on the CPU (None when there are none).

    Args:
        model: the loaded model (its other layers on the execution device).
        placement: the plan the model was loaded with.
        device: the execution device; default: the plan's.
        prefetch: default: when the plan left room for two streamed layers.
    """
    offloaded = placement.offloaded
    if not offloaded or placement.offload_device is None:
        return None
    names = [name for layer in offloaded for name in layer.modules]
    return layer_offload(model, device or placement.execution_device, layers=names,
                         host=placement.offload_device,
                         prefetch=placement.prefetch if prefetch is None else prefetch)


OffloadMode = Literal["sequential", "layers"]
_MODES: dict[str, Callable[..., Offload]] = {
    "sequential": lambda module, device, **kw: sequential_offload(module, device, **kw),
    "layers": lambda module, device, **kw: layer_offload(module, device, **kw),
}


def enable_offload(module: nn.Module, offload: OffloadMode, device: torch.device | str, **kwargs: Any) -> Offload:
    """``offload="sequential"`` (:func:`sequential_offload`) or ``"layers"`` (:func:`layer_offload`)."""
    if offload not in _MODES:
        raise ValueError(f"Unknown offload mode {offload!r}: use one of {', '.join(map(repr, _MODES))}.")
    return _MODES[offload](module, device, **kwargs)


@contextlib.contextmanager
def offloaded(module: nn.Module, offload: OffloadMode, device: torch.device | str, **kwargs: Any):
    """:func:`enable_offload` for the duration of a block; the hooks come off after."""
    handle = enable_offload(module, offload, device, **kwargs)
    try:
        yield handle
    finally:
        handle.remove()


def move_except_offloaded(model: nn.Module, device: torch.device | str, offload: Offload) -> None:
    """``model.to(device)`` that leaves the modules of ``offload`` alone (their masters stay on the host).

    Lightning's ``SingleDeviceStrategy.setup`` moves the whole model to its device; with
    layers offloaded, that would put every one of them on the device at once.
    """
    device = torch.device(device)
    skip = {id(m) for m in offload.modules.values()}

    def move(module: nn.Module) -> None:
        if id(module) in skip:
            return
        if not any(id(m) in skip for m in module.modules()):
            module.to(device)
            return
        module._apply(lambda t: t.to(device), recurse=False)  # its own tensors, then each child
        for child in module.children():
            move(child)

    move(model)
