"""The streaming loop: each target of the plan read alone, cast, moved, quantized and assigned, in module order.

::

    for each target:  read it as its route says (routes.py: whole, by rows, its parts combined or stacked, ...)
                      -> transform -> cast -> to device -> quantize (marked targets) or assign -> drop
                      [onto a CUDA device: read through the ring of host buffers, several at once, the copies
                       on a side stream overlapping the next reads; quantized there whole (staging.py)]
                      [a tensor stored block-quantized: read, transformed and cast a block of rows at a time
                       into its final tensor (row_reads.py)]
                      [a weight stored quantized: its parts read -> into its scheme's module as they are]

Peak memory is the final model plus about one tensor in flight (a combined tensor: its parts
and the result; a stacked one: one part). On an error the caller puts the module back as it was (``engine.load``).

A target that is a DTensor shard (``Target.shard``, its local part allocated by ``shard_fill.py``) is
filled in place: a block of rows read as stored goes straight into the local part (one ``read_rows``);
a weight whose scheme quantizes a rank's own rows (``torchao.nf4``) reads its rows, quantizes them with
the whole weight's sums agreed across the ranks (``shard_sums.py``) and copies the result in; any other
shard (a transform, another placement) reads the whole tensor as the one in flight, then copies this
rank's part (quantized: ``Quantizer.load_shard``).

Sharded, the stream runs inside a stage of ``ranks.agreement``: a rank that fails here goes straight to the
agreement at the end of the stream, where the others meet it. The one collective inside the stream (the
all-reduce of a weight's NF4 sums) is also the ranks' failure check (``ranks.agreement.checked_sum``), so that a
rank that failed earlier meets the others there instead of leaving them in the collective.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from tqdm.auto import tqdm

from lightning_lowmem.routes.reader import Payload, Reader, local_of
from lightning_lowmem.routes.readahead import read_ahead
from lightning_lowmem.routes.route import Route, Traits
from lightning_lowmem.routes.choice import QuantizedShardRows, route_of
from lightning_lowmem.ranks.shard_sums import ShardSums
from lightning_lowmem.routes.staging import Stager, load_window, open_stager
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.memory import collector_paused
from lightning_lowmem.meta import assign
from lightning_lowmem.plan import Combine, LoadPlan, Target
from lightning_lowmem.plan.conversions import Transform
from lightning_lowmem.quantize import Quantizer
from lightning_lowmem.quantize.rows import RowSource
from lightning_lowmem.quantize.workers import RowWorkers
from lightning_lowmem.runtime.execution import path_device  # the device path's device: the runtime's answer

READ_AHEAD_FINAL = 512 * 2**20
"""Bytes read ahead of the tensor being handled (see readahead.py): only where what is read
becomes the final tensor as it is (no cast, no move, no quantization), so it costs nothing. In a load that
quantizes, those reads (embeddings, norms, a head kept in full precision) run while weights are quantized."""



def stream(module: nn.Module, ckpt: Checkpoint, plan: LoadPlan, quantizer: Quantizer | None, *,
           transform: Transform | None = None, combine: Combine | None = None,
           progress: bool | None = None, mmap: bool = False) -> tuple[int, int, bool]:
    """Load every target of ``plan`` from ``ckpt`` into ``module``; returns ``(tensors, bytes read, mapped)``.

    With ``mmap``, when :func:`mappable` says the whole load may be mapped, each tensor is a view of its
    file's mapped pages (bytes read: 0) instead of a copy. Tensors going to a device with a copy engine (CUDA) take
    the device path (``staging.py``) when its ring can be had, else the routes they take without it.

    On an error the module is left as far as it got; the caller puts it back (``meta.Snapshot``).
    """
    mapped = mmap and mappable(plan, quantizer, transform)
    device = path_device(plan)
    traits = Traits.of(plan, ckpt, transform=transform, mapped=mapped, staged=device)
    routes = {id(target): route_of(target, traits) for target in plan.targets}
    staged = [route for route in routes.values() if route.staged]
    with open_stager(ckpt, staged, device, load_window(list(routes.values()))) as stager:
        if staged and stager is None:  # no ring: every tensor as without the device path
            traits = dataclasses.replace(traits, staged=None)
            routes = {id(target): route_of(target, traits) for target in plan.targets}
        tensors, nbytes = _stream(module, ckpt, plan, quantizer, routes, stager, transform, combine, progress)
    return tensors, nbytes, mapped


def _stream(module: nn.Module, ckpt: Checkpoint, plan: LoadPlan, quantizer: Quantizer | None,
            routes: dict[int, Route], stager: Stager | None, transform: Transform | None, combine: Combine | None,
            progress: bool | None) -> tuple[int, int]:
    """The loop of :func:`stream` along the chosen ``routes``: ``(tensors, bytes read)``."""
    window = read_window(list(routes.values()), transform is not None)
    bar = tqdm(total=plan.nbytes, unit="B", unit_scale=True, unit_divisor=1024, desc="Loading",
               disable=not (progress if progress is not None else sys.stderr.isatty()), leave=False)
    tensors = nbytes = 0
    # Only the loop's own objects are made here unless a quantizer or a transform runs: those may leave reference
    # cycles (torchao's int8 weights did: +120 MiB with the collector paused), so the collector keeps running then.
    paused = collector_paused() if quantizer is None and transform is None else nullcontext()
    sums = ShardSums(module, [t for t in plan.targets if routes[id(t)].kind == QuantizedShardRows.kind])
    ahead = lambda t: routes[id(t)].final and not routes[id(t)].staged  # noqa: E731  (the stager reads those)
    try:
        with torch.no_grad(), paused, row_workers_for(routes.values()) as workers:
            reader = Reader(module, ckpt, plan, combine, scratch_size(plan, routes), transform, workers)
            reader.staged = stager
            for target, tensor in read_ahead(plan.targets, lambda t: routes[id(t)].read(reader),
                                             lambda t: t.read_nbytes, window, accept=ahead):
                route = routes[id(target)]
                _install(module, target, tensor, quantizer, None if route.transformed else transform, sums)
                del tensor
                tensors += len(target.parts) or 1
                nbytes += route.read_nbytes
                bar.update(target.read_nbytes)
    finally:
        bar.close()
    return tensors, nbytes


def _install(module: nn.Module, target: Target, tensor: Payload, quantizer: Quantizer | None,
             transform: Transform | None, sums: ShardSums) -> None:
    """Put what was read for ``target`` into ``module``: quantized (a marked weight) or cast, moved and assigned."""
    if isinstance(tensor, RowSource):
        quantizer.load(module, target, tensor)  # cast and moved block by block already
        return
    if isinstance(tensor, dict):  # the parts of a weight stored quantized: into its module as they are
        quantizer.load_stored(module, target, tensor)
        return
    if target.shard is not None:
        _install_shard(module, target, tensor, quantizer, transform, sums)
        return
    if transform is not None:
        tensor = transform(target.names[0], tensor)
    tensor = tensor.to(dtype=target.dtype).to(device=target.device)
    if quantizer is None or not quantizer.load(module, target, tensor):
        assign(module, target.names, tensor, target.is_parameter)


def _install_shard(module: nn.Module, target: Target, tensor: torch.Tensor, quantizer: Quantizer | None,
                   transform: Transform | None, sums: ShardSums) -> None:
    """Fill this rank's part of a DTensor in place from what was read: its own rows, or the whole tensor."""
    local = local_of(module, target)
    shard = target.shard
    if local.numel() == 0 or (tensor.data_ptr() == local.data_ptr() and tensor.shape == local.shape):
        return  # read straight into place
    if transform is not None:
        tensor = transform(target.names[0], tensor)
    if target.scheme is not None and tuple(tensor.shape) != shard.shape:  # its own rows (QuantizedShardRows)
        rows = tensor.to(dtype=target.dtype).to(device=target.device)
        del tensor
        local.copy_(quantizer.load_own_rows(target, rows, sums.sum_across(target)))
        return
    if target.scheme is not None:
        local.copy_(quantizer.load_shard(target, tensor.to(dtype=target.dtype), shard.index, shard.count))
        return
    local.copy_(tensor[shard.region] if tuple(tensor.shape) == shard.shape else tensor)


def mappable(plan: LoadPlan, quantizer: Quantizer | None, transform: Transform | None) -> bool:
    """Whether every target goes to the CPU as it is stored: then the load may map the file instead of copying.

    One cast, move, quantized weight, transform or combined tensor and the whole load copies: a mapped
    tensor keeps its file's whole mapping alive, which a load that keeps only some tensors as stored
    must not (quantizing from mapped weights peaked at the bf16 model + the int8 one).
    """
    return quantizer is None and transform is None and all(
        not t.parts and t.shard is None and t.dtype == t.record.dtype and t.device.type == "cpu"
        for t in plan.targets)


def read_window(routes: list[Route], transform: bool) -> int:
    """Bytes read ahead of the tensor being handled: :data:`READ_AHEAD_FINAL`, for the routes that read a final tensor
    as it is (the others are read in turn); none when a transform runs on every tensor as read, or the load maps."""
    if transform or any(route.kind == "mapped" for route in routes):
        return 0
    return READ_AHEAD_FINAL


def row_workers_for(routes: Iterable[Route]) -> AbstractContextManager[RowWorkers | None]:
    """The threads that read and quantize blocks of rows for this load (``quantize/workers.py``), when a route reads
    several blocks at once; they end with the load."""
    return RowWorkers.for_cpu() if any(route.blocks > 1 for route in routes) else nullcontext()


def scratch_size(plan: LoadPlan, routes: dict[int, Route]) -> int:
    """Bytes of the reused read buffer: the largest read into it in the second half of the load.

    The buffer is held to the end, when the model is nearly complete, so it is sized to the transients
    of that part of the load; a larger tensor read early (litgpt reads ``lm_head`` first) gets fresh
    memory, freed at once, as without the buffer.
    """
    total, done, size = plan.nbytes, 0, 0
    for target in plan.targets:
        if done >= total / 2:
            size = max(size, routes[id(target)].scratch_nbytes)
        done += target.read_nbytes
    return size
