"""The layer streamer: the one executor of the modules kept off the execution device, each brought in from its
source for its own forward while the one before it computes.

::

    LayerStreamer(root, modules, source, device)
        the root's forward        runs inside a try/finally (``guard.py``: forward hooks miss a KeyboardInterrupt); its end, on
                                  every way out: what is installed released, the thread count back, the held reads
                                  dropped, the next forward's first fetch started (a source that reads ahead
                                  cyclically)
        before a module's forward the fetch of its tensors (started while the one before ran, else started now) waited
                                  for -> installed -> the next module's fetch started, in the order the forward
                                  takes (module order at first, then learned)
        after it                  released

A source says where tensors come from (``source.py``): the host (``host_copies.py``: masters copied to the device)
or the checkpoint file (``file_reads.py``: read into reused buffers on a reading thread of its own).

Interruption: a fetch in flight is never forgotten. It stays the pending one until it has ended, so a forward
interrupted while it waits (Ctrl-C, a ``TimeoutError`` raised by a signal handler) leaves it to the next forward,
which waits for it before anything reuses its buffer; and an error is the source's own (a read that failed) only
when the fetch itself raised it: the caller's interruption goes on as it is. Threads: while a read runs on the
source's thread beside a forward on the CPU, the forward computes on one thread fewer (``threads.py``: the
process-wide number untouched), given back at the end of the forward, on every way out.

One forward at a time: the fetches, the buffers they go into and the modules' tensors are shared, so a forward (of the
root, or of a streamed module run on its own) started on a second thread while one runs is refused with a
``RuntimeError`` naming the thread that runs; forwards one after another, from any thread, run.

Ownership, so that dropping the model releases the source at once (no collector pass): the root's guarded forward
holds the streamer; the streamer holds the root weakly; the modules' hooks hold the streamer weakly; when the root
goes, a finalizer closes the source (its reading thread and the file).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_lowmem.quantize import tensor_nbytes
from lightning_lowmem.runtime.guard import guard, unguard
from lightning_lowmem.runtime.one_forward import OneForward
from lightning_lowmem.runtime.source import Fetched, Source
from lightning_lowmem.threads import OwnThreads, own_threads
from lightning_lowmem.transfer import CopyEngine, engine_for


@dataclass
class StreamStats:
    """What a streamer did.

    Attributes:
        fetches: modules whose tensors were brought in for a forward (read, or copied from the host).
        prefetch_hits: of those, the ones whose fetch started before their forward (a full overlap when
            ``wait_seconds`` stays small).
        reads: reads from the checkpoint file (a layer of tied modules is read once per forward: one read).
        bytes_read: bytes read from the checkpoint file.
        read_seconds: seconds the fetches took, where they ran.
        wait_seconds: seconds forwards waited for them.
        resident_bytes: bytes of the fetched tensors held now (0 between forwards, but for a fetch started ahead).
        max_resident_bytes: the most held at once.
    """

    fetches: int = 0
    prefetch_hits: int = 0
    reads: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    wait_seconds: float = 0.0
    resident_bytes: int = 0
    max_resident_bytes: int = 0


@dataclass
class _Pending:
    name: str
    future: Future[Fetched]
    ahead: bool


class LayerStreamer:
    """Hooks that bring each of ``modules`` in from ``source`` for its forward, the next one fetched meanwhile.

    Args:
        root: the model whose forward runs the modules (its forward is guarded; a module may be the root itself).
        modules: name -> module, in the order they are expected to run.
        source: where their tensors come from.
        device: the execution device.
        prefetch: fetch the next module while the current one computes.

    Attributes:
        engine: the copy engine the source copies to the device through (``transfer/copies.py``: a side stream for
            CUDA); None where the device has none (the CPU: the disk tier computes from its read buffers).
    """

    def __init__(self, root: nn.Module, modules: Mapping[str, nn.Module], source: Source, device: torch.device | str,
                 *, prefetch: bool = True) -> None:
        self.device = torch.device(device)
        self.modules = dict(modules)
        self.source = source
        self.prefetch = prefetch
        self.stats = StreamStats()
        self._root = weakref.ref(root)
        names = list(self.modules)
        self._next: dict[str, str] = dict(zip(names, names[1:] + (names[:1] if source.cyclic else [])))
        self._prev: str | None = None
        self._active: dict[str, Fetched] = {}
        self._pending: _Pending | None = None
        self._broken: BaseException | None = None
        self._forward = False  # the root's forward is running
        self._one = OneForward()  # one forward at a time (one_forward.py)
        self._lowered: OwnThreads | None = None
        self._spare_core = source.background and self.device.type == "cpu"
        usable = self.device.type != "cuda" or torch.cuda.is_available()
        self.engine: CopyEngine | None = engine_for(self.device) if usable else None
        source.engine = self.engine
        self._handles: list[RemovableHandle] = []
        me = weakref.ref(self)
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(_before(me, name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(_after(me, name), always_call=True))
        guard(root, self)
        self._finalizer = weakref.finalize(root, _shutdown, source, self.engine)

    @property
    def streaming(self) -> str:
        """What moves for each forward, in words (``compile=True`` says it when it decodes eagerly)."""
        return f"{len(self.modules)} modules are brought in for each forward"

    @property
    def root(self) -> nn.Module | None:
        """The model (None once it was dropped)."""
        return self._root()

    def close(self) -> None:
        """Take the hooks off (a fetch in flight ends first); the source's tensors stay where they are kept
        (``source.detach``). Idempotent."""
        if not self._handles:
            return
        try:
            self._wait_pending()
        except Exception:  # noqa: BLE001  (a failed read: the file it failed on is closed all the same)
            pass
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.end_forward()
        root = self._root()
        unguard(root, self)
        self.source.detach(root)
        self._finalizer()

    remove = close

    def __enter__(self) -> LayerStreamer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the forward of the root

    def begin_forward(self) -> None:
        """Start of the root's forward.

        Raises:
            RuntimeError: a forward runs on another thread (nothing of it was touched).
        """
        self._enter("the model")
        self._one.depth += 1
        self._forward = True
        if not self.source.cyclic:
            self._prev = None  # a cyclic source learns the step from one forward's last module to the next's first

    def end_forward(self, hooks_follow: bool = False) -> None:
        """End of the root's forward (on every way out): releases, the thread count back, the next fetch started.

        ``hooks_follow``: the root's forward hooks run after this (it returned, or raised an ``Exception``), so a root
        that is one of the modules is left to its own hook (hooks registered before see its tensors)."""
        self._forward = False
        root = self._root() if hooks_follow else None
        try:
            for name in [n for n in self._active if self.modules[n] is not root]:
                self.source.release(name, self._active.pop(name))
            self.source.end_forward()
            if not self.source.cyclic:
                if self._prev is not None:
                    self._next.pop(self._prev, None)  # the last module has no successor
                self._drop_pending()
            elif self._prev is not None and self._handles:
                self._prefetch(self._next.get(self._prev))
        finally:
            if not self.source.cyclic:
                self._prev = None
            self._all_cores()
            self._account()
            self._leave()

    # ---- the modules' hooks

    def before(self, name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._enter(repr(name))
        self.source.check_forward(name)
        if self._broken is not None:
            raise self.source.fetch_error(self._broken) from self._broken
        if name in self._active:  # left installed by a forward interrupted outside the root's forward
            self.source.release(name, self._active.pop(name))
        if self._prev is not None and self._prev != name:
            self._next[self._prev] = name  # learn the order the forward really takes
        self._prev = name
        fetched = self._take(name)
        self._active[name] = fetched
        self._wait_copies(fetched)
        self.source.install(name, fetched)
        self._prefetch(self._next.get(name))
        if self._forward and self._reading():
            self._leave_a_core()
        self._account()
        return (apply_to_collection(args, torch.Tensor, self._to_device),
                apply_to_collection(kwargs, torch.Tensor, self._to_device))

    def after(self, name: str) -> None:
        fetched = self._active.pop(name, None)
        if fetched is not None:
            self.source.release(name, fetched)
        self._account()
        if not self._one.depth and not self._active:
            self._leave()  # a module run on its own, not through the root's forward

    def _enter(self, what: str) -> None:
        self._one.enter(what, self.streaming)

    def _leave(self) -> None:
        self._one.leave()

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    # ---- fetches

    def _take(self, name: str) -> Fetched:
        """``name``'s tensors: held from earlier in this forward, the fetch started ahead when the guess was right,
        else a fetch made now."""
        held = self.source.held(name)
        if held is not None:
            self.stats.fetches += 1
            return held
        if self._pending is not None and not self.source.same_fetch(self._pending.name, name):
            self._drop_pending()  # a wrong guess: it ends first (its buffer may be the one this fetch takes)
        if self._pending is None:
            self._start(name, ahead=False)
        ahead = self._pending.ahead
        fetched = self._wait_pending()
        self.stats.prefetch_hits += ahead
        return fetched

    def _prefetch(self, name: str | None) -> None:
        """Start fetching ``name`` while the current module computes, when there is room and nothing in flight."""
        if name is None or not self.prefetch or self._pending is not None or self._broken is not None \
                or name in self._active:
            return
        self._start(name, ahead=True)

    def _start(self, name: str, *, ahead: bool) -> None:
        claim = self.source.claim(name, ahead)
        if claim is None:
            return  # nothing to fetch ahead into (or nothing to fetch: held already)
        if self.source.background:
            future = self.source.executor.submit(self._timed, name, claim, self.engine)
        else:
            future = Future()
            try:
                future.set_result(self._timed(name, claim, self.engine))
            except BaseException as e:  # the fetch's own error, raised when it is waited for
                future.set_exception(e)
        self._pending = _Pending(name, future, ahead)

    def _timed(self, name: str, claim: Any, engine: CopyEngine | None) -> Fetched:
        start = time.perf_counter()
        fetched = self.source.fetch(name, claim, engine)
        fetched.seconds = time.perf_counter() - start
        return fetched

    def _wait_pending(self) -> Fetched | None:
        """The fetch in flight, once it has ended (None: none). Interrupted meanwhile, it stays the pending one."""
        pending = self._pending
        if pending is None:
            return None
        start = time.perf_counter()
        try:
            fetched = pending.future.result()
        except BaseException as e:
            future = pending.future
            if not (future.done() and not future.cancelled() and future.exception() is e):
                raise  # the caller's own (Ctrl-C, a signal handler's TimeoutError): the fetch goes on
            self._pending = None
            error = self.source.fetch_error(e)
            if error is None:
                raise
            self._broken = e
            raise error from e
        finally:
            self.stats.wait_seconds += time.perf_counter() - start
        self._pending = None
        self.stats.fetches += 1
        self.stats.reads += fetched.reads
        self.stats.bytes_read += fetched.bytes_read
        self.stats.read_seconds += fetched.seconds
        return fetched

    def _drop_pending(self) -> None:
        """The fetch in flight ended and dropped (a wrong guess, or the end of a forward)."""
        if self._pending is not None:
            self._wait_pending()

    def _reading(self) -> bool:
        """Whether a fetch started ahead is still running."""
        return self._pending is not None and not self._pending.future.done()

    def _wait_copies(self, fetched: Fetched) -> None:
        """The calling thread's work on the fetched tensors starts after their copies (on CUDA: its stream waits for
        the side stream's event, and the tensors are recorded on it)."""
        if self.engine is not None:
            self.engine.hand_over(fetched.flat(), fetched.fence)

    # ---- threads and accounting

    def _leave_a_core(self) -> None:
        """While a read runs on the source's thread beside a forward on the CPU, compute on one thread fewer.

        The read is a copy (from the page cache, at memory speed) that takes a core as long as it runs; computing
        beside it on every core makes both wait on each other (pythia-1.4b at 1/5 of its weights on 2 cores:
        0.32 s per token, and 0.23 with a core left to the read; docs/benchmarks.md). The calling thread's count
        only (``threads.py``), and only inside the root's forward, whose end gives it back on every way out."""
        if not self._spare_core or self._lowered is not None:
            return
        threads = torch.get_num_threads()
        if threads > 1:
            self._lowered = own_threads(threads - 1)

    def _all_cores(self) -> None:
        lowered, self._lowered = self._lowered, None
        if lowered is not None:
            lowered.restore()

    def _account(self) -> None:
        held = [*self._active.values()]
        future = self._pending.future if self._pending is not None else None
        if future is not None and future.done() and not future.cancelled() and future.exception() is None:
            held.append(future.result())
        seen: set[tuple[str, int]] = set()
        resident = sum(tensor_nbytes(t, seen) for f in held for t in f.flat())
        self.stats.resident_bytes = resident
        self.stats.max_resident_bytes = max(self.stats.max_resident_bytes, resident)


def _before(ref: weakref.ref[LayerStreamer], name: str) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        streamer = ref()
        return None if streamer is None else streamer.before(name, args, kwargs)
    return hook


def _after(ref: weakref.ref[LayerStreamer], name: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        streamer = ref()
        if streamer is not None:
            streamer.after(name)
    return hook


def _shutdown(source: Source, engine: CopyEngine | None) -> None:
    """The streamer closed, or its model dropped: the source lets go of what it holds (its reading thread, the file),
    then the copy engine (every copy done first)."""
    try:
        source.shutdown()
    finally:
        if engine is not None:
            engine.close()
