"""Python's cyclic garbage collector paused while a load builds many objects at once.

A load builds a few Python objects per tensor (its record, its place in the plan, its parameter), none of
them garbage and none in a reference cycle. The collector runs every 700 allocations and, as the objects
pile up, scans all of them again and again: loading 100,000 scalar tensors spent 35% of its time in it
(1.1 of 3.0 s), more than ``torch.load`` and ``safetensors`` spend per tensor in all. It is paused where
only such objects are made (reading headers, planning, and streaming when nothing is quantized or
transformed), and runs again after. Code that leaves reference cycles behind must not run paused: loading
with torchao's int8 quantization paused peaked 120 MiB higher, its garbage collected only at the end.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the block; it is enabled again after, if it was enabled before
    (reference counting frees memory as usual meanwhile). The collector is process-wide: other threads see it
    paused too.

    Example::

        >>> with collector_paused():
        ...     gc.isenabled()
        False
        >>> gc.isenabled()
        True
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
