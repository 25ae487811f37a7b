"""The disk tier: layers left in the checkpoint file, each read for its own forward while the previous one computes.

::

    after the load, each module of a layer the placement left on disk (``"disk"``) holds placeholders (one element,
    expanded to each tensor's shape: no memory), and two hooks:
        before its forward   wait for its read (started while the previous layer computed; else read it now)
                             -> its tensors point into the read buffer (on CUDA: copied there on a side stream)
                             -> the next layer's read starts into the other buffer, in a background thread
        after its forward    the placeholders back; its buffer is free for the read after next
    the order is module order at first, then the order the forward takes (learned as layer offload learns it), and
    cyclic: the first layer's read starts during the last one, so the next token's first layer is ready

Each tensor is read along its route (``routes.py``: the one decision the load made too) into its slot of the
buffer (``layer_buffers.py``): read there as it is kept, else read, cast or transformed and copied in. A weight
stored quantized is read as stored, its parts into their slots, and handed to its scheme's layout.

The checkpoint (opened once, by the load) is checked unchanged after every read: a file changed, replaced or cut
short under a running model is a :class:`CheckpointChangedError` at that forward and every later one, never a
forward on other weights; reads stay within the offsets of the plan (``formats/files.py``). The tier owns the
open checkpoint when the load opened it (``load_checkpoint(path, ...)``): :meth:`DiskTier.close` (or dropping the
model, once a read in flight has ended) closes it; a :class:`~lightning_lowmem.Checkpoint` passed in open stays
its caller's, who keeps it open.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_lowmem.runtime.disk_units import ON_DISK, DiskUnit
from lightning_lowmem.engine.prepare import PreparedLoad
from lightning_lowmem.runtime.layer_buffers import LayerBuffers, Slot, to_device, view
from lightning_lowmem.engine.reader import Payload, Reader, SharedParts
from lightning_lowmem.engine.route import Route, Traits
from lightning_lowmem.errors import CheckpointChangedError, CheckpointError
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.memory import format_bytes
from lightning_lowmem.plan import Combine, LoadPlan, Target
from lightning_lowmem.plan.conversions import Transform


@dataclass
class DiskStats:
    """What the disk tier did. ``prefetch_hits``: layers whose read started before their forward (a full overlap when
    ``wait_seconds`` stays small)."""

    reads: int = 0
    prefetch_hits: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    wait_seconds: float = 0.0


@dataclass
class _Fetched:
    name: str
    index: int  # the buffer read into; -1: memory of its own
    tensors: list[Payload]
    event: Any = None  # a CUDA event: the copies to the device are done


def open_disk_tier(prepared: PreparedLoad, ckpt: Checkpoint) -> DiskTier | None:
    """The disk tier of a prepared load whose placement left layers on disk (None when it left none): placeholders
    in their modules, hooks on, the first one's read started."""
    placement = prepared.placement
    if placement is None or not placement.on_disk:
        return None
    targets = on_disk_targets(prepared)
    units = {}
    for name in (m for layer in placement.on_disk for m in layer.modules):
        units[name] = [t for t in targets if any(n == name or n.startswith(f"{name}.") for n in t.names)]
    traits = Traits.of(LoadPlan(targets), ckpt, transform=prepared.transform)
    return DiskTier(prepared.module, units, ckpt, traits=traits, combine=prepared.combine,
                    transform=prepared.transform, device=prepared.device)


def on_disk_targets(prepared: PreparedLoad) -> list[Target]:
    """The targets of a prepared load that stay in the checkpoint file (none without a disk tier)."""
    placement = prepared.placement
    if placement is None or not placement.on_disk:
        return []
    return [t for t in prepared.plan.targets if placement.is_on_disk(t.names[0])]


class DiskTier:
    """Hooks that read each module of the layers on disk for its forward, the next one read meanwhile.

    Built by the load (``LoadReport.disk``); :meth:`close` (or :meth:`remove`) takes the hooks off, puts those
    modules' tensors back on meta and closes the checkpoint it owns. Inference only: a forward with autograd
    enabled raises.

    Args:
        root: the loaded model.
        units: module name -> the targets of its tensors, in the order they are expected to run.
        ckpt: the open checkpoint.
        traits, combine, transform: the load's (so each tensor takes the route and conversion it took at load).
        device: the execution device.
    """

    def __init__(self, root: nn.Module, units: dict[str, list[Target]], ckpt: Checkpoint, *, traits: Traits,
                 combine: Combine | None, transform: Transform | None, device: torch.device) -> None:
        self.root, self.ckpt, self.device = root, ckpt, torch.device(device)
        self.units = {name: DiskUnit.of(root, name, targets, traits) for name, targets in units.items()}
        self.stats = DiskStats()
        self._transform = transform
        scratch = max((r.scratch_nbytes for u in self.units.values() for r in u.routes), default=0)
        self._reader = Reader(root, ckpt, LoadPlan([]), combine, scratch, transform)
        cuda = self.device.type == "cuda"
        self._buffers = LayerBuffers(max(u.nbytes for u in self.units.values()), pin=cuda)
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lowmem-disk")
        self._owned = contextlib.ExitStack()
        self._finalizer = weakref.finalize(self, _shutdown, self._pool, self._owned)
        names = list(self.units)
        self._next: dict[str, str] = dict(zip(names, names[1:] + names[:1]))
        self._prev: str | None = None
        self._active: dict[str, _Fetched] = {}
        self._pending: tuple[str, int, Future[_Fetched]] | None = None
        self._broken: BaseException | None = None
        self._handles: list[RemovableHandle] = []
        for unit in self.units.values():
            self._hook(unit)
        self._full_threads: int | None = None  # torch's thread count while a forward leaves a core to the reads
        if self.device.type == "cpu":
            self._handles.append(root.register_forward_hook(lambda *_: self._all_cores(), always_call=True))
        self._prefetch(names[0])  # the first layer is read while the model is handed out

    @property
    def buffer_bytes(self) -> int:
        """Host memory of the two read buffers."""
        return 2 * self._buffers.nbytes

    @property
    def read_nbytes(self) -> int:
        """Bytes read from the checkpoint for each forward (every module on disk once)."""
        return sum(u.read_nbytes for u in self.units.values())

    def stored_modules(self) -> dict[str, str]:
        """Module name -> scheme, for the modules on disk whose weight the checkpoint holds quantized."""
        return {t.names[0].rpartition(".")[0]: t.scheme.name for u in self.units.values() for t in u.targets
                if t.stored is not None}

    def own(self, resources: contextlib.ExitStack) -> None:
        """Close ``resources`` (the load's open checkpoint) with the tier."""
        self._owned.push(resources)

    def close(self) -> None:
        """Take the hooks off, put the modules on disk back on meta (a later forward says so), close the checkpoint
        if the tier owns it. Idempotent."""
        if not self._handles:
            return
        with contextlib.suppress(CheckpointChangedError):
            self._wait_pending()  # a read in flight ends first; the file it failed on is closed all the same
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._all_cores()  # a module on disk run on its own (not through the model) may have left a core to a read
        for name in list(self._active):
            self.units[name].release()
        self._active.clear()
        advice = f"Its tensors were read from {self.ckpt.description}, and that disk tier was closed: load it again."
        for unit in self.units.values():
            unit.module.__dict__.pop("_apply", None)
            unit.module.__dict__.pop(ON_DISK, None)
            unit.unplace(self.root, advice)
        self._finalizer()  # the reading thread stops, the checkpoint it owns is closed

    remove = close

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __str__(self) -> str:
        return (f"{len(self.units)} modules read from {self.ckpt.description} for each forward: "
                f"{format_bytes(self.read_nbytes)} per forward, into 2 x {format_bytes(self._buffers.nbytes)} buffers")

    # ---- hooks

    def _hook(self, unit: DiskUnit) -> None:
        """Placeholders in, the two hooks on; ``.to()`` and casts leave the module alone (its tensors come from the
        file: moving or casting the placeholders would allocate them whole)."""
        unit.place(self.root)
        module = unit.module
        module.__dict__["_apply"] = lambda fn, recurse=True: module
        module.__dict__[ON_DISK] = self.ckpt.description
        self._handles.append(module.register_forward_pre_hook(self._before(unit.name)))
        self._handles.append(module.register_forward_hook(self._after(unit.name), always_call=True))

    def _before(self, name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            if torch.is_grad_enabled():
                raise RuntimeError(
                    f"{name!r} is read from {self.ckpt.description} for each forward (disk_offload): that is for "
                    "inference, and this forward records gradients. Run it under torch.no_grad() or "
                    "torch.inference_mode(); training through layers on disk is not supported (raise max_memory so "
                    "that the model stays in memory, or quantize it).")
            if self._broken is not None:
                raise self._changed(self._broken)
            if self._prev is not None and self._prev != name:
                self._next[self._prev] = name  # learn the order the forward really takes
            self._prev = name
            fetched = self._take(name)
            self._active[name] = fetched
            self._wait_copies(fetched)
            self.units[name].install(self.root, fetched.tensors, self.device)
            self._prefetch(self._next.get(name))
            if self._reading():
                self._leave_a_core()
        return hook

    def _after(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self._active.pop(name, None)
            self.units[name].release()
            if not self._reading():
                self._all_cores()
        return hook

    def _leave_a_core(self) -> None:
        """While a read runs beside a forward on the CPU, compute on one thread fewer than torch's setting.

        The read is a copy (from the page cache, at memory speed) that takes a core as long as it runs; computing
        beside it on every core makes both wait on each other (pythia-1.4b at 1/5 of its weights on 2 cores:
        0.32 s per token, and 0.23 with a core left to the read; docs/benchmarks.md). Given back as soon as no
        read runs (after a module on disk whose successor's read has ended, and after the model's forward)."""
        if self.device.type != "cpu" or self._full_threads is not None:
            return
        threads = torch.get_num_threads()
        if threads > 1:
            self._full_threads = threads
            torch.set_num_threads(threads - 1)

    def _reading(self) -> bool:
        """Whether a read started ahead is still running."""
        return self._pending is not None and not self._pending[2].done()

    def _all_cores(self) -> None:
        if self._full_threads is not None:
            torch.set_num_threads(self._full_threads)
            self._full_threads = None

    # ---- reads

    def _take(self, name: str) -> _Fetched:
        """``name``'s tensors: the read started ahead when the guess was right, else one made now."""
        pending = self._wait_pending()
        if pending is not None and pending.name == name:
            self.stats.prefetch_hits += 1
            return pending
        return self._guarded(lambda: self._read(self.units[name], self._free_index()))

    def _prefetch(self, name: str | None) -> None:
        """Start reading ``name`` into a free buffer, in the background."""
        if name is None or name in self._active or self._broken is not None:
            return
        index = self._free_index()
        if index >= 0:
            self._pending = (name, index, self._pool.submit(self._read, self.units[name], index))

    def _wait_pending(self) -> _Fetched | None:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        start = time.perf_counter()
        try:
            return self._guarded(pending[2].result)
        finally:
            self.stats.wait_seconds += time.perf_counter() - start

    def _guarded(self, read: Any) -> _Fetched:
        try:
            return read()
        except (CheckpointError, OSError) as e:
            self._broken = e
            raise self._changed(e) from e

    def _changed(self, cause: BaseException) -> CheckpointChangedError:
        what = str(cause).split("; the weights read so far")[0].rstrip(".")  # the load's advice does not apply here
        return CheckpointChangedError(
            f"A layer of the model could not be read from {self.ckpt.description}, which the model reads its layers "
            f"on disk from for each forward (disk_offload): {what}. The model stops here, and at every later forward, "
            "rather than run on other weights: load it again once the file is whole and nothing writes to it.")

    def _free_index(self) -> int:
        """A buffer no installed module uses (-1: both in use, by modules running one inside the other)."""
        used = {f.index for f in self._active.values()}
        return next((i for i in (0, 1) if i not in used), -1)

    def _read(self, unit: DiskUnit, index: int) -> _Fetched:
        """Read ``unit``'s tensors into buffer ``index`` (and copy them to the device); runs in the reading thread."""
        start = time.perf_counter()
        if index >= 0:
            self._buffers.free(index)
            buffer = self._buffers.buffer(index)
        else:
            buffer = torch.empty(unit.nbytes, dtype=torch.uint8)
        reader = self._reader
        reader.parts = SharedParts(self.ckpt, LoadPlan(unit.targets))  # parts two of its targets share: read once
        tensors = [self._read_target(reader, buffer, target, route, slots)
                   for target, route, slots in zip(unit.targets, unit.routes, unit.slots)]
        self.ckpt.check_unchanged()  # a write during these reads: not these bytes
        event = None
        if self._stream is not None:
            tensors, event = to_device(tensors, self.device, self._stream)
            if index >= 0:
                self._buffers.copied(index, event)
        self.stats.reads += 1
        self.stats.bytes_read += unit.read_nbytes
        self.stats.read_seconds += time.perf_counter() - start
        return _Fetched(unit.name, index, tensors, event)

    def _read_target(self, reader: Reader, buffer: torch.Tensor, target: Target, route: Route,
                     slots: list[Slot]) -> Payload:
        """``target`` read along ``route`` into its slots: as it is kept when it can be, else read, converted and
        copied in."""
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
            return {p.key: _into(payload[p.key], out) for p, out in zip(target.parts, views)}
        if not isinstance(payload, torch.Tensor):
            raise RuntimeError(f"{target.names[0]!r} would be quantized for each forward; check_streamable refuses "
                               "that before any read.")
        if self._transform is not None and not route.transformed:  # a route that took blocks of rows ran it already
            payload = self._transform(target.names[0], payload)
        return _into(payload, views[0])

    def _wait_copies(self, fetched: _Fetched) -> None:
        """On CUDA: the current stream waits for the copies made on the side stream, which then belong to it."""
        if fetched.event is None:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_event(fetched.event)
        for t in _tensors(fetched.tensors):
            t.record_stream(current)


def _into(tensor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` holding ``tensor`` (nothing copied when ``tensor`` is ``out`` already)."""
    if tensor.data_ptr() == out.data_ptr() and tensor.shape == out.shape and tensor.dtype == out.dtype:
        return out
    out.copy_(tensor)
    return out


def _tensors(payloads: list[Payload]) -> list[torch.Tensor]:
    return [t for p in payloads for t in (p.values() if isinstance(p, dict) else [p])]


def _shutdown(pool: ThreadPoolExecutor, owned: contextlib.ExitStack) -> None:
    """Stop the reading thread and close what the tier owns (also when the model is dropped without close(), from
    whichever thread collects it: nothing is waited for here)."""
    pool.shutdown(wait=False, cancel_futures=True)
    owned.close()
