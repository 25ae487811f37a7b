"""Offloading: weights live on the CPU and visit the execution device only for their own forward.

Two modes, one mechanism (the layer streamer, ``streamer.py``, with the host as its source, ``host_copies.py``):

* ``"sequential"``: whole submodules (a text encoder that runs once per prompt)
  are copied to the device before their forward and dropped after, as
  accelerate's ``cpu_offload`` does.
* ``"layers"``: each transformer block is copied in for its forward while the
  next one is already being copied on a side CUDA stream, so the transfer
  overlaps the compute. The order is learned from the forward itself.

The CPU copy is the master: the device copies are temporary and dropped after
each forward (no second copy stays on the device), so in-place changes made
on the device are not kept: this is for inference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import nn

from lightning_lowmem.placement.layers import find_blocks
from lightning_lowmem.placement.place import PlacementPlan
from lightning_lowmem.plan import LoadPlan
from lightning_lowmem.runtime.execution import ExecutionPlan
from lightning_lowmem.runtime.host_copies import HostCopies, Weights
from lightning_lowmem.runtime.streamer import LayerStreamer


class Offload(LayerStreamer):
    """Hooks that copy the weights of ``modules`` to ``device`` for their forward and drop them after.

    Build it with :func:`enable_offload` or :func:`dispatch`; :meth:`remove` takes the hooks
    off and leaves the masters in place (on the host). ``stats`` (a
    :class:`~lightning_lowmem.runtime.streamer.StreamStats`) counts the copies.

    Args:
        root: the model whose forward runs the modules (None: the one module offloaded).
        modules: name -> module to offload, in the order they are expected to run.
        device: the execution device.
        host: where the masters live.
        prefetch: copy the next module while the current one computes.
        pin: pin the masters (default: when ``device`` is CUDA).
        groups: module names whose masters share one block of host memory (a placement's layers); default: each
            module alone.
    """

    def __init__(self, root: nn.Module | None, modules: Mapping[str, nn.Module], device: torch.device | str, *,
                 host: torch.device | str = "cpu", prefetch: bool = True, pin: bool | None = None,
                 groups: list[list[str]] | None = None) -> None:
        device = torch.device(device)
        if root is None:
            if len(modules) != 1:
                raise ValueError(f"Offload needs root= (the model whose forward runs them) for {len(modules)} "
                                 "modules; without one it offloads a single module.")
            root = next(iter(modules.values()))
        pin = device.type == "cuda" and torch.cuda.is_available() if pin is None else pin
        source = HostCopies(modules, device, torch.device(host), pin, groups)
        super().__init__(root, modules, source, device, prefetch=prefetch)

    @property
    def streaming(self) -> str:
        return f"{len(self.modules)} layers are offloaded to the CPU and copied in for each forward"

    @property
    def weights(self) -> dict[str, Weights]:
        """Module name -> its offloaded tensors (masters on the host)."""
        return self.source.weights

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of the masters kept on the host (a tensor several modules share, once)."""
        return self.source.nbytes

    @property
    def pinned_bytes(self) -> int:
        """Host memory the masters take: their blocks, whole pages, pinned for CUDA (what the placement counts on the
        CPU for the layers it offloaded)."""
        return self.source.pinned_bytes


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


def dispatch(model: nn.Module, plan: PlacementPlan | ExecutionPlan, *, device: torch.device | str | None = None,
             prefetch: bool | None = None) -> Offload | None:
    """Layer offload for the layers the plan keeps on the CPU (None when there are none).

    Args:
        model: the loaded model (its other layers on the execution device).
        plan: the placement the model was loaded with, or the execution plan made from it.
        device: the execution device; default: the plan's.
        prefetch: default: when the plan left room for two streamed layers.
    """
    execution = plan if isinstance(plan, ExecutionPlan) else ExecutionPlan.of(LoadPlan([]), plan, plan.execution_device)
    placement = execution.placement
    if placement is None or not execution.offloaded:
        return None
    groups = [list(layer.modules) for layer in execution.offloaded]
    modules = {name: model.get_submodule(name) for group in groups for name in group}
    return Offload(model, modules, device or execution.device, host=placement.offload_device,
                   prefetch=placement.prefetch if prefetch is None else prefetch, groups=groups)


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
