"""The streaming loop: each target of the plan read alone, cast, moved, quantized and assigned, in module order.

::

    for each target:  read it alone [or its parts, combined | or a block of rows at a time]
                      -> transform -> cast -> to device -> quantize (marked targets) or assign -> drop
                      [a weight stored quantized: its parts read -> into its scheme's module as they are]

Peak memory is the final model plus about one tensor in flight (a combined tensor: its parts
and the result). On an error the caller puts the module back as it was (``engine.load``).

A target that is a DTensor shard (``Target.shard``, its local part allocated by ``shard_fill.py``) is
filled in place: a block of rows read as stored goes straight into the local part (one ``read_rows``);
any other shard (a cast, a quantized weight, a transform, another placement) reads the whole tensor
as the one in flight, then copies this rank's part (quantized: ``Quantizer.load_shard``).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from lightning_lowmem.engine.shard_fill import local_tensor
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.memory import collector_paused
from lightning_lowmem.meta import assign, owner_of
from lightning_lowmem.plan import Combine, LoadPlan, Target
from lightning_lowmem.quantize import Quantizer
from lightning_lowmem.quantize.rows import RowSource
from lightning_lowmem.engine.readahead import ScratchBuffer, read_ahead

READ_AHEAD_FINAL = 512 * 2**20
"""Bytes read ahead of the tensor being handled (see readahead.py): only where what is read
becomes the final tensor as it is (no cast, no move, no quantization), so it costs nothing."""

Transform = Callable[[str, torch.Tensor], torch.Tensor]


def stream(module: nn.Module, ckpt: Checkpoint, plan: LoadPlan, quantizer: Quantizer | None, *,
           transform: Transform | None = None, combine: Combine | None = None,
           progress: bool | None = None, mmap: bool = False) -> tuple[int, int, bool]:
    """Load every target of ``plan`` from ``ckpt`` into ``module``; returns ``(tensors, bytes read, mapped)``.

    With ``mmap``, when :func:`mappable` says the whole load may be mapped, each tensor is a view of its
    file's mapped pages (bytes read: 0) instead of a copy.

    On an error the module is left as far as it got; the caller puts it back (``meta.Snapshot``).
    """
    reads = _Reads(module, ckpt, plan, quantizer, transform, combine,
                   mmap=mmap and mappable(plan, quantizer, transform))
    bar = tqdm(total=plan.nbytes, unit="B", unit_scale=True, unit_divisor=1024, desc="Loading",
               disable=not (progress if progress is not None else sys.stderr.isatty()), leave=False)
    tensors = nbytes = 0
    # Only the loop's own objects are made here unless a quantizer or a transform runs: those may leave reference
    # cycles (torchao's int8 weights did: +120 MiB with the collector paused), so the collector keeps running then.
    paused = collector_paused() if quantizer is None and transform is None else contextlib.nullcontext()
    try:
        with torch.no_grad(), paused:
            for target, tensor in read_ahead(plan.targets, reads.read, lambda t: t.read_nbytes, reads.window):
                _install(module, target, tensor, quantizer, transform)
                del tensor
                size = target.read_nbytes
                tensors += len(target.parts) or 1
                nbytes += reads.bytes_of(target, size)
                bar.update(size)
    finally:
        bar.close()
    return tensors, nbytes, reads.mapped


def _install(module: nn.Module, target: Target, tensor: torch.Tensor | RowSource | dict[str, torch.Tensor],
             quantizer: Quantizer | None, transform: Transform | None) -> None:
    """Put what was read for ``target`` into ``module``: quantized (a marked weight) or cast, moved and assigned."""
    if isinstance(tensor, RowSource):
        quantizer.load(module, target, tensor)  # cast and moved block by block already
        return
    if isinstance(tensor, dict):  # the parts of a weight stored quantized: into its module as they are
        quantizer.load_stored(module, target, tensor)
        return
    if target.shard is not None:
        _install_shard(module, target, tensor, quantizer, transform)
        return
    if transform is not None:
        tensor = transform(target.names[0], tensor)
    tensor = tensor.to(dtype=target.dtype).to(device=target.device)
    if quantizer is None or not quantizer.load(module, target, tensor):
        assign(module, target.names, tensor, target.is_parameter)


def _install_shard(module: nn.Module, target: Target, tensor: torch.Tensor, quantizer: Quantizer | None,
                   transform: Transform | None) -> None:
    """Fill this rank's part of a DTensor in place from what was read: its own rows, or the whole tensor."""
    local = _local(module, target)
    shard = target.shard
    if local.numel() == 0 or (tensor.data_ptr() == local.data_ptr() and tensor.shape == local.shape):
        return  # read straight into place
    if transform is not None:
        tensor = transform(target.names[0], tensor)
    if target.scheme is not None:
        local.copy_(quantizer.load_shard(target, tensor.to(dtype=target.dtype), shard.index, shard.count))
        return
    local.copy_(tensor[shard.region] if tuple(tensor.shape) == shard.shape else tensor)


def _local(module: nn.Module, target: Target) -> torch.Tensor:
    owner, leaf = owner_of(module, target.names[0])
    return local_tensor(getattr(owner, leaf))


def mappable(plan: LoadPlan, quantizer: Quantizer | None, transform: Transform | None) -> bool:
    """Whether every target goes to the CPU as it is stored: then the load may map the file instead of copying.

    One cast, move, quantized weight, transform or combined tensor and the whole load copies: a mapped
    tensor keeps its file's whole mapping alive, which a load that keeps only some tensors as stored
    must not (quantizing from mapped weights peaked at the bf16 model + the int8 one).
    """
    return quantizer is None and transform is None and all(
        not t.parts and t.shard is None and t.dtype == t.record.dtype and t.device.type == "cpu"
        for t in plan.targets)


class _Reads:
    """How each target is read: mapped, into a reused scratch buffer, by blocks of rows, from combined parts,
    or plainly."""

    def __init__(self, module: nn.Module, ckpt: Checkpoint, plan: LoadPlan, quantizer: Quantizer | None,
                 transform: Transform | None, combine: Combine | None, mmap: bool = False) -> None:
        self.module, self.ckpt, self.quantizer = module, ckpt, quantizer
        self.transform, self.combine = transform, combine
        self.mapped = mmap
        transient = quantizer is not None or transform is not None or any(
            t.parts or t.dtype != t.record.dtype or t.device.type != "cpu"
            or (t.shard is not None and not self.own_rows(t)) for t in plan.targets)
        self.window = 0 if transient or self.mapped else READ_AHEAD_FINAL  # transient reads are never read ahead
        size = _scratch_size(plan, lambda t: self._copied(t) and not self.by_rows(t), self._tensor_nbytes) \
            if self.window == 0 else 0
        self.scratch = ScratchBuffer(size) if size else None
        self.scratch_size = size
        self.parts = _SharedParts(ckpt, plan)

    def by_rows(self, target: Target) -> bool:
        """Quantized a block of rows at a time, each read on its own: the whole weight is never read."""
        return (self.quantizer is not None and self.transform is None and not target.parts
                and len(target.record.shape) == 2 and self.quantizer.by_rows(target)
                and self.ckpt.reads_rows(target.record.key))

    def own_rows(self, target: Target) -> bool:
        """A DTensor shard whose rows this rank reads on its own (else the whole tensor is read)."""
        return target.own_rows is not None and self.transform is None and self.ckpt.reads_rows(target.record.key)

    def bytes_of(self, target: Target, read_nbytes: int) -> int:
        """Bytes read for ``target``, whose ``read_nbytes`` is given."""
        if self.mapped:
            return 0
        if target.shard is not None and not self.own_rows(target):
            return sum(r.nbytes for r in target.parts) if target.parts else target.record.nbytes
        return read_nbytes

    def _tensor_nbytes(self, target: Target) -> int:
        """Bytes of the tensor read for ``target`` as it comes out of the file (a GGUF tensor: dequantized)."""
        rec = target.record
        if target.shard is not None and self.own_rows(target):
            start, stop = target.own_rows
            return rec.tensor_nbytes // max(rec.shape[0], 1) * (stop - start)
        return rec.tensor_nbytes

    def _copied(self, target: Target) -> bool:
        """Whether what is read for ``target`` is copied before the next read (so it may be read into scratch)."""
        if target.shard is not None and not target.parts:  # copied unless read straight into the local part
            return not self.own_rows(target) or target.dtype != target.record.dtype or target.device.type != "cpu"
        return not target.parts and (target.dtype != target.record.dtype or target.device.type != "cpu"
                                     or target.scheme is not None)

    def read(self, target: Target) -> torch.Tensor | RowSource | dict[str, torch.Tensor]:
        if target.shard is not None and self.own_rows(target):
            return self._read_own_rows(target)
        if self.mapped:
            tensor = self.ckpt.map(target.record.key)
            if tensor is not None:
                return tensor
        if target.stored is not None:
            return {p.key: self.ckpt.read(p.key) for p in target.parts}
        if target.parts:
            return _read_combined(self.parts, target, self.combine)
        if self.by_rows(target):
            return _row_source(self.ckpt, target)
        rec = target.record
        if self.scratch is not None and rec.tensor_nbytes <= self.scratch_size and self._copied(target):
            return self.ckpt.read(rec.key, out=self.scratch.view(rec.shape, rec.dtype))
        return self.ckpt.read(rec.key)

    def _read_own_rows(self, target: Target) -> torch.Tensor:
        """This rank's rows of ``target``: into its local part when stored as it is kept, else into scratch."""
        rec, (start, stop) = target.record, target.own_rows
        local = _local(self.module, target)
        if start == stop:
            return local
        if not self._copied(target) and local.is_contiguous():
            return self.ckpt.read_rows(rec.key, start, stop, out=local)
        shape = (stop - start, *rec.shape[1:])
        out = None
        if self.scratch is not None and self._tensor_nbytes(target) <= self.scratch_size:
            out = self.scratch.view(shape, rec.dtype)
        return self.ckpt.read_rows(rec.key, start, stop, out=out)


def _row_source(ckpt: Checkpoint, target: Target) -> RowSource:
    """``target``'s weight as blocks of rows, each read from the file into one reused buffer, cast and moved."""
    rec = target.record
    row_elements = math.prod(rec.shape[1:])
    buffer = torch.empty(0, dtype=rec.dtype)

    def rows(start: int, stop: int) -> torch.Tensor:
        nonlocal buffer
        if start == 0 and stop == rec.shape[0]:  # the whole weight: its own memory, nothing shared
            block = ckpt.read(rec.key)
        else:
            n = (stop - start) * row_elements
            if buffer.numel() < n:
                buffer = torch.empty(n, dtype=rec.dtype)
            block = ckpt.read_rows(rec.key, start, stop, out=buffer[:n].view(stop - start, *rec.shape[1:]))
        return block.to(dtype=target.dtype).to(device=target.device)

    return RowSource(rec.shape, target.dtype, target.device, rows)


class _SharedParts:
    """Reads the parts of combined targets; a part that a later target also needs is read once and held till then.

    litgpt splits Phi-3's ``gate_up_proj`` into ``fc_1`` and ``fc_2``: without this it was read twice.
    """

    def __init__(self, ckpt: Checkpoint, plan: LoadPlan) -> None:
        self._ckpt = ckpt
        self._uses: dict[str, int] = {}
        for target in plan.targets:
            for part in target.parts:
                self._uses[part.key] = self._uses.get(part.key, 0) + 1
        self._held: dict[str, torch.Tensor] = {}

    def take(self, key: str) -> torch.Tensor:
        tensor = self._held.pop(key, None)
        if tensor is None:
            tensor = self._ckpt.read(key)
        self._uses[key] -= 1
        if self._uses[key] > 0:
            self._held[key] = tensor
        return tensor


def _read_combined(parts: _SharedParts, target: Target, combine: Combine) -> torch.Tensor:
    """The target's parts read one after the other (fresh memory each) and combined; the parts are then dropped."""
    tensor = combine.fn(target.record.key, {p.key: parts.take(p.key) for p in target.parts})
    if tensor.untyped_storage().nbytes() > tensor.nbytes:  # a slice of a part would keep the whole part alive
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _scratch_size(plan: LoadPlan, copied: Callable[[Target], bool], tensor_nbytes: Callable[[Target], int]) -> int:
    """Bytes of the reused read buffer: the largest ``copied`` tensor read in the second half of the load.

    The buffer is held to the end, when the model is nearly complete, so it is sized to the transients
    of that part of the load; a larger tensor read early (litgpt reads ``lm_head`` first) gets fresh
    memory, freed at once, as without the buffer.
    """
    total, done, size = plan.nbytes, 0, 0
    for target in plan.targets:
        if done >= total / 2 and copied(target):
            size = max(size, tensor_nbytes(target))
        done += target.read_nbytes
    return size
