"""What a layer streamer (``streamer.py``) brings modules in from: the base class of its two sources, and what one
fetch hands it.

::

    claim(name, ahead)         on the forward's thread: what a fetch of ``name`` writes into (a buffer), or None
    fetch(name, claim, engine) the tensors of ``name``, copied to the device through the streamer's copy engine
                               (``transfer/copies.py``; None: the CPU, nothing to copy through); on the source's
                               reading thread when it has one (``background``)
    held(name)                 the tensors of ``name`` kept from earlier in this forward, or None (nothing fetched)
    same_fetch(a, b)           whether a fetch of ``a`` serves ``b`` as well (tied modules: one read)
    install / release          the module's tensors pointed at a fetch, and back
    end_forward                the end of the model's forward: what was kept for it dropped
    fetch_error(error)         the source's own error for a fetch that raised ``error`` (None: raise it as it is)
    detach(root) / shutdown()  the streamer closed / the model dropped: the source lets go of what it holds

The host copies (``host_copies.py``) and the file reads (``file_reads.py``) are the two.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from lightning_lowmem.transfer import CopyEngine, Fence


@dataclass
class Fetched:
    """One fetch: a module's tensors as installed (on the execution device), and what it cost.

    Attributes:
        name: the module fetched.
        tensors: one per tensor the source installs (a dict of parts for a weight stored quantized).
        fence: the end of the copies made to the device (the copy engine's; None: done, or none made).
        claim: what the source wrote into (its buffer), handed back at release.
        host: the tensors as fetched on the host, before any copy to the device (file reads keep these).
        reads: reads from the checkpoint file it made (0 or 1).
        bytes_read: bytes it read from the checkpoint file.
        seconds: how long it took.
    """

    name: str
    tensors: list[Any]
    fence: Fence | None = None
    claim: Any = None
    host: list[Any] = field(default_factory=list)
    reads: int = 0
    bytes_read: int = 0
    seconds: float = 0.0

    def flat(self) -> list[torch.Tensor]:
        """Every tensor it holds (the parts of a weight stored quantized one by one)."""
        return [t for p in self.tensors for t in (p.values() if isinstance(p, dict) else [p])]


class Source:
    """Where a streamer's modules' tensors come from (see the module docstring for each method).

    Attributes:
        background: fetches run on the source's :attr:`executor` (a reading thread), not on the forward's.
        cyclic: the next forward's first module is fetched as a forward ends (what is fetched into is the source's
            own memory, not the device's).
        executor: the reading thread, for a background source.
        engine: the streamer's copy engine (set by the streamer), for copies made outside ``fetch``.
    """

    background: ClassVar[bool] = False
    cyclic: ClassVar[bool] = False
    executor: ThreadPoolExecutor | None = None
    engine: CopyEngine | None = None

    def claim(self, name: str, ahead: bool) -> Any:
        return 0

    def fetch(self, name: str, claim: Any, engine: CopyEngine | None) -> Fetched:
        raise NotImplementedError

    def held(self, name: str) -> Fetched | None:
        return None

    def same_fetch(self, a: str, b: str) -> bool:
        return a == b

    def install(self, name: str, fetched: Fetched) -> None:
        raise NotImplementedError

    def release(self, name: str, fetched: Fetched) -> None:
        raise NotImplementedError

    def end_forward(self) -> None:
        return None

    def check_forward(self, name: str) -> None:
        return None

    def fetch_error(self, error: BaseException) -> BaseException | None:
        return None

    def detach(self, root: nn.Module | None) -> None:
        return None

    def shutdown(self) -> None:
        return None
