"""The checkpoint file as a source (``source.py``): the layers left on disk, each read for its forward into a reused
host buffer on a reading thread of its own, while the layer before it computes.

::

    after the load, each module of a layer on disk holds placeholders (one element, expanded to each tensor's
    shape: no memory); the streamer (``streamer.py``) asks, for each module's forward:
        claim      a buffer no installed module computes from (two, used in turn: the largest layer on disk each)
        fetch      the layer read into it along the routes the load took (``engine/disk_reads.py`` reads), the file
                   checked unchanged after the read; on CUDA copied to the device on the side stream
        install    its tensors pointed into the buffer (or at the device copies)
        release    the placeholders back; the buffer is free for the read after next
    a layer of tied modules (an embedding and the head that shares its weight) is read once per forward into a
    buffer of its own and kept until the last of its modules ran: each forward reads each layer once, the bytes
    the placement counts (``PlacementPlan.disk_read_bytes``)

The checkpoint (opened once, by the load) is checked unchanged after every read: a file changed, replaced or cut
short under a running model is a :class:`CheckpointChangedError` at that forward and every later one, never a
forward on other weights. Only the reads' own errors become that: an error raised while a forward waits (a
``KeyboardInterrupt``, a signal handler's ``TimeoutError``) is the caller's, and goes on as it is. The source owns
the open checkpoint when the load opened it (``load_checkpoint(path, ...)``): closing the tier, or dropping the
model, stops the reading thread and closes it at once.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from lightning_lowmem.errors import CheckpointChangedError, CheckpointError
from lightning_lowmem.runtime.disk_model import mark, unmark
from lightning_lowmem.runtime.disk_units import DiskUnit
from lightning_lowmem.runtime.layer_buffers import LayerBuffers, to_device
from lightning_lowmem.runtime.source import Fetched, Source
from lightning_lowmem.transfer import CopyEngine

ReadLayer = Callable[[DiskUnit, torch.Tensor], list[Any]]
"""Reads a layer's targets into a buffer (into its slots where it can) and returns them, one per target; checks the
file unchanged after. The engine gives it (``engine/disk_reads.py``): it reads along the load's routes."""


class FileReads(Source):
    """Layers on disk, each read for its forward by ``read`` into a reused buffer.

    Args:
        root: the loaded model.
        units: the layers on disk, in module order.
        read: reads a layer into a buffer (see :data:`ReadLayer`).
        description: the checkpoint's files, for messages.
        device: the execution device.
    """

    background = True
    cyclic = True

    def __init__(self, root: nn.Module, units: list[DiskUnit], read: ReadLayer, *, description: str,
                 device: torch.device) -> None:
        self.units = {unit.name: unit for unit in units}
        self.description = description
        self.device = device
        self._root = weakref.ref(root)
        self._read = read
        self._unit_of = {name: unit for unit in units for name in unit.modules}
        held = [unit for unit in units if unit.held]
        largest = max((unit.nbytes for unit in units if not unit.held), default=0)
        self._own_buffer = {unit.name: 2 + i for i, unit in enumerate(held)}
        self.buffers = LayerBuffers([largest, largest] + [unit.nbytes for unit in held], device)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lowmem-disk")
        self._owned = contextlib.ExitStack()
        self._using: dict[str, int] = {}  # module installed -> the buffer it computes from
        self._held: dict[str, Fetched] = {}  # layer of tied modules -> its read for this forward
        self._ran: dict[str, set[str]] = {}  # layer of tied modules -> those of its modules that ran since
        for unit in units:
            unit.place(root)
        modules = {name: root.get_submodule(name) for unit in units for name in unit.modules}
        dtypes = {t.dtype for m in modules.values() for t in [*m.parameters(), *m.buffers()]}
        self._model = mark(root, modules, dtypes, description)  # copies, saves and casts refused (disk_model.py)

    def own(self, resources: contextlib.ExitStack) -> None:
        """Close ``resources`` (the load's open checkpoint) with the source."""
        self._owned.push(resources)

    # ---- the streamer's questions

    def claim(self, name: str, ahead: bool) -> int | None:
        """The buffer a read of ``name``'s layer goes into: its own for tied modules (None while held: nothing to
        read), else one of the two no installed module uses (-1: fresh memory, when a read is needed now and both
        are in use by modules running one inside the other; None: none to read ahead into)."""
        unit = self._unit_of[name]
        if unit.held:
            return None if unit.name in self._held else self._own_buffer[unit.name]
        used = set(self._using.values())
        free = next((i for i in (0, 1) if i not in used), None)
        if free is None:
            return None if ahead else -1
        return free

    def fetch(self, name: str, claim: int, engine: CopyEngine | None) -> Fetched:
        """Read ``name``'s layer into buffer ``claim`` (and copy it to the device through ``engine``); runs on the
        reading thread."""
        unit = self._unit_of[name]
        if claim >= 0:
            self.buffers.free(claim)
            buffer = self.buffers.buffer(claim)
        else:
            buffer = torch.empty(unit.nbytes, dtype=torch.uint8)
        host = self._read(unit, buffer)
        tensors, fence = host, None
        if engine is not None:
            tensors, fence = to_device(host, engine)
            if claim >= 0:
                self.buffers.copied(claim, fence)
        return Fetched(name, tensors, fence, claim, host, reads=1, bytes_read=unit.read_nbytes)

    def held(self, name: str) -> Fetched | None:
        """The read of ``name``'s layer this forward, when its tied module ran first (on CUDA copied again). A read
        serves each module of the layer once: a module that runs again starts a new pass (a forward that skipped
        the head, a module run on its own), read again."""
        unit = self._unit_of[name]
        read = self._held.get(unit.name)
        if read is not None and name in self._ran.get(unit.name, ()):
            self._drop(unit.name)
            read = None
        if read is None:
            return None
        if self.engine is None:
            return Fetched(name, read.host, None, read.claim, read.host)
        tensors, fence = to_device(read.host, self.engine)
        self.buffers.copied(read.claim, fence)
        return Fetched(name, tensors, fence, read.claim, read.host)

    def same_fetch(self, a: str, b: str) -> bool:
        """One read serves every module of a layer (the modules of tied ones)."""
        return self._unit_of[a] is self._unit_of[b]

    def install(self, name: str, fetched: Fetched) -> None:
        unit = self._unit_of[name]
        if unit.held:
            self._held.setdefault(unit.name, fetched)
        else:
            self._using[name] = fetched.claim
        unit.install(self._root(), fetched.tensors, self.device)

    def release(self, name: str, fetched: Fetched) -> None:
        unit = self._unit_of[name]
        unit.release()
        self._using.pop(name, None)
        if unit.held:
            ran = self._ran.setdefault(unit.name, set())
            ran.add(name)
            if ran >= set(unit.modules):  # every module served: read again for the next forward
                self._drop(unit.name)

    def end_forward(self) -> None:
        self._held.clear()
        self._ran.clear()

    def _drop(self, layer: str) -> None:
        self._held.pop(layer, None)
        self._ran.pop(layer, None)

    def check_forward(self, name: str) -> None:
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{name!r} is read from {self.description} for each forward (disk_offload): that is for "
                "inference, and this forward records gradients. Run it under torch.no_grad() or "
                "torch.inference_mode(); training through layers on disk is not supported (raise max_memory so "
                "that the model stays in memory, or quantize it).")

    def fetch_error(self, error: BaseException) -> BaseException | None:
        """A read that failed (the file changed, cut short, unreadable): the model stops, here and at every later
        forward. Any other error is not the file's, and goes on as it is."""
        if not isinstance(error, (CheckpointError, OSError)):
            return None
        what = str(error).split("; the weights read so far")[0].rstrip(".")  # the load's advice does not apply here
        return CheckpointChangedError(
            f"A layer of the model could not be read from {self.description}, which the model reads its layers "
            f"on disk from for each forward (disk_offload): {what}. The model stops here, and at every later forward, "
            "rather than run on other weights: load it again once the file is whole and nothing writes to it.")

    # ---- closing

    def detach(self, root: nn.Module | None) -> None:
        """The layers on disk back on meta for good (a later forward says so)."""
        if root is None:
            return
        advice = f"Its tensors were read from {self.description}, and that disk tier was closed: load it again."
        unmark(self._model)
        for unit in self.units.values():
            unit.unplace(root, advice)

    def shutdown(self) -> None:
        """Stop the reading thread (a read in flight ends first, unless this is that thread) and close what the
        source owns: called on close, and when the model is dropped."""
        reading = threading.current_thread().name.startswith("lowmem-disk")
        self.executor.shutdown(wait=not reading, cancel_futures=True)
        self._owned.close()

