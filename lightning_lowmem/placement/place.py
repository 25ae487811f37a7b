"""Placement: which layer goes to which device under the budgets, from the load plan alone.

The execution device (see :mod:`.budgets`) first reserves room for what a forward
needs besides the weights:

    caches       KV cache + mask + RoPE tables for ``batch_size x context`` tokens
                 (the model's :class:`~.architectures.Architecture`; or ``kv_cache_bytes=``)
    activations  a forward's activations (the same architecture; or ``activation_bytes=``)
    streaming    room for the layers streamed in from the CPU: the largest offloaded layer,
                 plus the second largest when the next one is prefetched while the current one computes

Layers (whole transformer blocks, see :mod:`.layers`) then take the rest of the
accelerator in module order; a layer that does not fit goes to the CPU, whose
budget holds the offloaded weights (the master copies that :mod:`.offload`
streams in) as the host memory they take: one block per layer, its tensors carved
64-byte aligned, whole pages, pinned for the accelerator (``Layer.pinned_nbytes``).
Each layer's bytes are its targets' ``final_nbytes``: the target
dtype, quantized exactly where the load quantizes. The plan is arithmetic:
device names need not exist on this machine.

With the disk tier (``disk_offload=True``), a layer that fits no budget stays in the
checkpoint file (device ``"disk"``) and is read for each of its forwards into one of two
host buffers the size of the largest such layer (``runtime/file_reads.py``); a layer of tied
modules (an embedding and its head) into a buffer of its own, kept from the first of its modules
to the last. The budgets hold what stays in memory; the read buffers come beside them
(``disk_buffer_bytes``), and each forward reads every layer on disk once (``disk_read_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_lowmem.errors import MemoryBudgetError
from lightning_lowmem.memory.units import format_bytes
from lightning_lowmem.placement.budgets import HOST, Budgets
from lightning_lowmem.placement.layers import Layer, group_layers
from lightning_lowmem.plan import LoadPlan

DISK = "disk"
"""The device name of layers that stay in the checkpoint file and are read for each forward (``disk_offload``)."""
DISK_BUFFERS = 2
"""Host buffers the layers on disk are read into: the one a layer computes from, and the next one's."""


@dataclass
class PlacementPlan:
    """Where each layer goes, and the bytes that puts on each device. ``str(plan)`` is a table.

    Attributes:
        layers: every layer in module order, each with its ``device``.
        budgets: device -> bytes allowed, execution device first.
        execution_device: where every layer runs (offloaded ones are streamed in).
        offload_device: ``'cpu'`` when layers may be offloaded there, else None.
        cache_bytes: KV cache, mask and RoPE bytes reserved on the execution device.
        activation_bytes: activation bytes reserved on the execution device.
        stream_buffers: offloaded layers the execution device holds at once: 0 (none
            offloaded), 1, or 2 (the next one is prefetched while the current one computes).
        context: tokens the caches were sized for (None: no cache reserved).
        batch_size: batch the caches and activations were sized for.
        quantize: the scheme the weight bytes assume.
        disk: layers that fit no budget may stay in the checkpoint file (``disk_offload=True``).
        read_bandwidth: bytes per second the checkpoint file is read at, for :meth:`seconds_per_token`
            (given, or measured by the estimate); None when not known.
    """

    layers: list[Layer]
    budgets: dict[str, int]
    execution_device: str
    offload_device: str | None
    cache_bytes: int = 0
    activation_bytes: int = 0
    stream_buffers: int = 0
    context: int | None = None
    batch_size: int = 1
    quantize: str | None = None
    disk: bool = False
    read_bandwidth: float | None = None
    _device_of: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def offloaded(self) -> list[Layer]:
        """The layers kept on the CPU and streamed to the execution device for their forward."""
        if self.offload_device is None:
            return []
        return [layer for layer in self.layers if layer.device == self.offload_device]

    @property
    def on_disk(self) -> list[Layer]:
        """The layers left in the checkpoint file and read for each of their forwards (``disk_offload``)."""
        return [layer for layer in self.layers if layer.device == DISK]

    @property
    def streamed(self) -> list[Layer]:
        """The layers copied into the execution device's memory for their forward: those offloaded to the CPU, and
        those on disk when the execution device is an accelerator (on the CPU they compute from the read buffers)."""
        return self.offloaded + (self.on_disk if self.execution_device != HOST else [])

    @property
    def stream_bytes(self) -> int:
        """Room reserved on the execution device for streamed-in layers: the ``stream_buffers`` largest."""
        sizes = sorted((layer.nbytes for layer in self.streamed), reverse=True)
        return sum(sizes[:self.stream_buffers])

    @property
    def disk_read_bytes(self) -> int:
        """Bytes read from the checkpoint file for each forward (each generated token): every layer on disk."""
        return sum(layer.read_nbytes for layer in self.on_disk)

    @property
    def disk_buffer_bytes(self) -> int:
        """Host memory the layers on disk are read into, beside the budgets: two buffers of the largest of them, and
        one of its own for each layer of tied modules (kept from the first of them to the last in a forward); each a
        block of whole pages (``Layer.buffer_nbytes``), pinned for an accelerator."""
        tied = sum(layer.buffer_nbytes for layer in self.on_disk if layer.tied)
        return DISK_BUFFERS * max((layer.buffer_nbytes for layer in self.on_disk if not layer.tied), default=0) + tied

    @property
    def pinned_bytes(self) -> int:
        """Host memory the offloaded layers' masters take: a block of whole pages per layer, each part carved
        64-byte aligned (``Layer.pinned_nbytes``), pinned for the accelerator they are copied to. What the CPU's
        budget holds for them, and what ``Offload.pinned_bytes`` holds once they are dispatched."""
        return sum(layer.pinned_nbytes for layer in self.offloaded)

    def seconds_per_token(self, read_bandwidth: float | None = None) -> float | None:
        """Seconds each forward spends reading the layers on disk, at ``read_bandwidth`` bytes per second (default:
        the plan's); None when no bandwidth is known. The next layer is read while this one computes, so this is
        the time per token wherever reading is slower than computing.

        Example::

            >>> plan = PlacementPlan([Layer("h.0", ["h.0"], nbytes=10, read_nbytes=10, device="disk")],
            ...                      {"cpu": 100}, "cpu", None, disk=True)
            >>> plan.seconds_per_token(read_bandwidth=20.0)
            0.5
        """
        bandwidth = read_bandwidth if read_bandwidth is not None else self.read_bandwidth
        if not self.on_disk:
            return 0.0
        return self.disk_read_bytes / bandwidth if bandwidth else None

    @property
    def prefetch(self) -> bool:
        """Whether the budget leaves room to prefetch the next offloaded layer."""
        return self.stream_buffers >= 2

    def weights_per_device(self) -> dict[str, int]:
        """Weight bytes the plan puts on each device (and ``"disk"``: left in the checkpoint file)."""
        out = dict.fromkeys([*self.budgets, *([DISK] if self.disk else [])], 0)
        for layer in self.layers:
            out[layer.device] += layer.nbytes
        return out

    def reserved_per_device(self) -> dict[str, int]:
        """Bytes reserved beside the weights: caches, activations and streaming room on the execution device; on the
        CPU, what the offloaded layers' blocks take beyond their weights (alignment, whole pages)."""
        out = dict.fromkeys(self.budgets, 0)
        out[self.execution_device] = self.cache_bytes + self.activation_bytes + self.stream_bytes
        if self.offload_device is not None and self.offload_device != self.execution_device:
            out[self.offload_device] = self.pinned_bytes - sum(layer.nbytes for layer in self.offloaded)
        return out

    def used_per_device(self) -> dict[str, int]:
        """Weights plus reserved bytes on each device: never above its budget."""
        weights, reserved = self.weights_per_device(), self.reserved_per_device()
        return {device: weights[device] + reserved[device] for device in self.budgets}

    def to_dict(self) -> dict[str, Any]:
        """The plan's numbers, for JSON: budgets, weights, reserved and used bytes per device, and each layer.

        Example::

            >>> plan = PlacementPlan([Layer("h.0", ["h.0"], nbytes=10, device="cpu")], {"cpu": 100}, "cpu", None)
            >>> plan.to_dict()["used"], plan.to_dict()["layers"]
            ({'cpu': 10}, [{'name': 'h.0', 'bytes': 10, 'device': 'cpu'}])
        """
        return {"execution_device": self.execution_device, "offload_device": self.offload_device,
                "budgets": dict(self.budgets), "weights": self.weights_per_device(),
                "reserved": self.reserved_per_device(), "used": self.used_per_device(),
                "cache_bytes": self.cache_bytes, "activation_bytes": self.activation_bytes,
                "stream_bytes": self.stream_bytes, "stream_buffers": self.stream_buffers, "context": self.context,
                "batch_size": self.batch_size, "quantize": self.quantize,
                "disk": {"layers": len(self.on_disk), "read_bytes_per_forward": self.disk_read_bytes,
                         "buffer_bytes": self.disk_buffer_bytes, "read_bandwidth": self.read_bandwidth,
                         "seconds_per_token": self.seconds_per_token()} if self.disk else None,
                "layers": [{"name": layer.name, "bytes": layer.nbytes, "device": layer.device} for layer in self.layers]}

    def device_of(self, tensor_name: str) -> torch.device:
        """The device the plan gives the tensor ``tensor_name`` (any of its tied names); for a layer on disk, the host,
        where its read buffers are."""
        if not self._device_of:
            self._device_of = {name: layer.device for layer in self.layers for name in layer.tensors}
        device = self._device_of[tensor_name]
        return torch.device(HOST if device == DISK else device)

    def is_on_disk(self, tensor_name: str) -> bool:
        """Whether the tensor ``tensor_name`` (any of its tied names) stays in the checkpoint file."""
        self.device_of(tensor_name)  # fills the table
        return self._device_of[tensor_name] == DISK

    def __str__(self) -> str:
        weights, reserved, used = self.weights_per_device(), self.reserved_per_device(), self.used_per_device()
        ctx = f"context {self.context} x batch {self.batch_size}" if self.context else "no KV cache reserved"
        lines = [f"Placement plan ({ctx}, quantize={self.quantize}); layers run on {self.execution_device}",
                 f"  {'device':<10}{'budget':>12}{'weights':>12}{'reserved':>12}{'used':>12}"]
        for device, budget in self.budgets.items():
            lines.append(f"  {device:<10}{format_bytes(budget):>12}{format_bytes(weights[device]):>12}"
                         f"{format_bytes(reserved[device]):>12}{format_bytes(used[device]):>12}")
        lines.append(f"  reserved on {self.execution_device}: caches {format_bytes(self.cache_bytes)}, activations "
                     f"{format_bytes(self.activation_bytes)}, streaming {format_bytes(self.stream_bytes)} "
                     + (f"(the {self.stream_buffers} largest offloaded layers"
                        f"{', for prefetch' if self.prefetch else ''})" if self.stream_buffers else "(none offloaded)"))
        if self.on_disk:
            lines.append(self._disk_line())
        lines += [f"  {name:<34}{size:>22}  {device}" for name, size, device in _runs(self.layers)]
        return "\n".join(lines)

    def _disk_line(self) -> str:
        n = len(self.on_disk)
        tied = sum(layer.buffer_nbytes for layer in self.on_disk if layer.tied)
        largest = (self.disk_buffer_bytes - tied) // DISK_BUFFERS
        buffers = f"{DISK_BUFFERS} x {format_bytes(largest)}" + (f" + {format_bytes(tied)} (tied)" if tied else "")
        line = (f"  on disk (read from the checkpoint file for each forward): {n} layer{'s' if n > 1 else ''}, "
                f"{format_bytes(self.weights_per_device()[DISK])}; {format_bytes(self.disk_read_bytes)} read per "
                f"token, into {buffers} host buffers beside the budgets")
        seconds = self.seconds_per_token()
        if seconds is not None:
            line += f"; ~{seconds:.3g} s/token reading at {format_bytes(self.read_bandwidth)}/s"
        return line


def _runs(layers: list[Layer]) -> list[tuple[str, str, str]]:
    """Table rows, consecutive blocks with the same size and device folded into one row."""
    rows: list[tuple[str, str, str]] = []
    run: list[Layer] = []

    def flush() -> None:
        if len(run) == 1:
            rows.append((run[0].name, format_bytes(run[0].nbytes), run[0].device))
        elif run:
            prefix = run[0].name.rpartition(".")[0]
            name = f"{prefix}.{run[0].name.rpartition('.')[2]}-{run[-1].name.rpartition('.')[2]}"
            rows.append((name, f"{len(run)} x {format_bytes(run[0].nbytes)}", run[0].device))
        run.clear()

    for layer in layers:
        if run and not (layer.is_block and run[-1].is_block and layer.nbytes == run[-1].nbytes
                        and layer.device == run[-1].device):
            flush()
        run.append(layer)
    flush()
    return rows


def place_layers(
    module: nn.Module,
    plan: LoadPlan,
    budgets: Budgets,
    *,
    cache_bytes: int = 0,
    activation_bytes: int = 0,
    context: int | None = None,
    batch_size: int = 1,
    quantize: str | None = None,
    disk: bool = False,
) -> PlacementPlan:
    """Place the layers of ``plan`` within ``budgets``, reserving ``cache_bytes`` and ``activation_bytes``
    on the execution device; writes each target's device into ``plan``.

    With ``disk``, a layer that fits no budget stays in the checkpoint file (``"disk"``; its targets' device is
    the host, where it is read for each forward).

    Raises:
        MemoryBudgetError: the execution device cannot hold one layer plus its cache, or the
            model does not fit in all budgets together; ``.needed`` and ``.available`` are bytes.
    """
    placement = PlacementPlan(group_layers(module, plan), dict(budgets.bytes), budgets.execution_device,
                              budgets.offload_device, cache_bytes=cache_bytes, activation_bytes=activation_bytes,
                              context=context, batch_size=batch_size, quantize=quantize, disk=disk)
    _check_one_layer_fits(placement)
    try:
        _assign(placement, buffers=2)
    except MemoryBudgetError:
        _assign(placement, buffers=1)  # no room to prefetch: stream one layer at a time
    for target in plan.targets:
        target.device = placement.device_of(target.names[0])
    return placement


_DISK_FIX = "pass disk_offload=True to leave the layers that do not fit in the checkpoint file and read them for " \
            "each forward"


def _check_one_layer_fits(p: PlacementPlan) -> None:
    """Fail early when the execution device cannot run even the largest layer with its caches (on the CPU with the
    disk tier, a layer is run from its read buffer: only what cannot be offloaded must fit)."""
    fixed = sum(layer.nbytes for layer in p.layers if not layer.movable)
    largest = max((layer for layer in p.layers if layer.movable), key=lambda layer: layer.nbytes, default=None)
    from_buffers = p.disk and p.execution_device == HOST
    streamed = largest.nbytes if largest is not None and not from_buffers else 0
    needed = p.cache_bytes + p.activation_bytes + fixed + streamed
    available = p.budgets[p.execution_device]
    if needed > available:
        what = f"its largest layer {largest.name!r} ({format_bytes(largest.nbytes)})" if streamed else "its layers"
        disk = f", or {_DISK_FIX}" if p.execution_device == HOST and not p.disk else ""
        raise MemoryBudgetError(
            f"max_memory[{p.execution_device!r}] = {format_bytes(available)} cannot hold one layer plus its cache: "
            f"{what}, KV cache/mask/RoPE for {p.context or 0} tokens x batch {p.batch_size} "
            f"({format_bytes(p.cache_bytes)}), activations ({format_bytes(p.activation_bytes)})"
            + (f" and tensors that cannot be offloaded ({format_bytes(fixed)})" if fixed else "")
            + f" need {format_bytes(needed)} ({needed} bytes), available {available} bytes. "
            f"Raise the budget, shorten the context, or quantize (e.g. quantize='bnb.nf4'){disk}.",
            needed=needed, available=available)


def _assign(p: PlacementPlan, buffers: int) -> None:
    """Keep the most weight bytes on the execution device; the rest goes to the CPU (then, with the disk tier, to
    the checkpoint file).

    The streaming room depends on the largest offloaded layer, so each distinct layer
    size ``s`` is tried as a cap: layers above ``s`` must stay, the others fill what is
    left in module order, and ``buffers x s`` is reserved for streaming. The cap that
    keeps the most bytes resident wins (the smallest such cap: the smallest buffers).
    Raise when no cap fits the budgets.
    """
    caps = sorted({0} | {layer.nbytes for layer in p.layers if layer.movable})
    best: tuple[int, int] | None = None  # (resident bytes, cap)
    least_over: tuple[int, int] = (-1, caps[-1])  # (bytes over budget, cap)
    for cap in caps:
        over = _fill(p, buffers, cap)
        resident = p.weights_per_device()[p.execution_device]
        if over == 0 and (best is None or resident > best[0]):
            best = (resident, cap)
        elif over and (least_over[0] < 0 or over < least_over[0]):
            least_over = (over, cap)
    if best is not None:
        _fill(p, buffers, best[1])
        return
    _fill(p, buffers, least_over[1])
    used = p.used_per_device()
    over = [d for d, b in p.budgets.items() if used[d] > b]
    needed, available = sum(used[d] for d in over), sum(p.budgets[d] for d in over)
    raise MemoryBudgetError(
        "The model does not fit in max_memory: "
        + ", ".join(f"{d} needs {format_bytes(used[d])} of {format_bytes(p.budgets[d])}" for d in over)
        + f" (weights {format_bytes(sum(layer.nbytes for layer in p.layers))} in all; needed {needed} bytes, "
        f"available {available} bytes). Raise the budgets"
        + (", add 'cpu' to max_memory to offload layers" if p.offload_device is None else "")
        + (f", {_DISK_FIX}" if not p.disk else "")
        + " or quantize (e.g. quantize='bnb.nf4').", needed=needed, available=available)


def _fill(p: PlacementPlan, buffers: int, cap: int) -> int:
    """Place every layer with offloaded layers capped at ``cap`` bytes; return the bytes over budget.

    A layer goes to the execution device when it fits, else to the CPU (``offload_device``) when it fits there,
    else to the disk with the disk tier (else to the CPU, over its budget).
    """
    execution, offload = p.execution_device, p.offload_device
    beyond = [device for device in (offload, DISK if p.disk else None) if device is not None]
    visits = execution != HOST and bool(beyond)  # layers beyond it are streamed into its memory
    free = {execution: p.budgets[execution] - p.cache_bytes - p.activation_bytes - (buffers * cap if visits else 0)}
    if offload is not None:
        free[offload] = p.budgets[offload]
    stay = {id(layer) for layer in p.layers if not layer.movable or layer.nbytes > cap or not beyond}
    for layer in p.layers:
        if id(layer) in stay:
            layer.device = execution
            free[execution] -= layer.nbytes
    for layer in p.layers:
        if id(layer) in stay:
            continue
        cost = {execution: layer.nbytes, offload: layer.pinned_nbytes}  # offloaded: its block of host memory
        fits = next((d for d in (execution, offload) if d is not None and cost[d] <= free[d]), None)
        layer.device = fits or (DISK if p.disk else beyond[0])
        if fits is not None:
            free[fits] -= cost[fits]
    p.stream_buffers = buffers if p.streamed else 0
    p._device_of = {}
    used = p.used_per_device()
    return sum(max(0, used[d] - b) for d, b in p.budgets.items())
