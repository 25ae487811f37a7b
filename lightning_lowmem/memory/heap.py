"""Giving freed heap memory back to the operating system (glibc).

glibc serves allocations below its mmap threshold from heaps that only shrink
from the top, and it raises that threshold (up to 32 MiB) each time a large
mapped block is freed. A load that frees a full-precision weight and keeps its
smaller quantized copy therefore leaves holes in the heap, which still count
in RSS: on pythia-1b, quantizing to bnb.int8 in blocks of rows kept the freed
temporaries resident and peaked 700 MiB above the final model, 120 MiB with a
trim after each weight. ``malloc_trim(0)`` returns those pages
(``MADV_DONTNEED``) without moving anything; it walks every free block, so it
is only called when ``mallinfo2`` says enough is free.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        info = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    info.argtypes = []
    info.restype = _MallInfo2
    return info


def free_heap_bytes() -> int | None:
    """Bytes that glibc holds free in its heaps (all arenas), or None where that cannot be asked."""
    info = _mallinfo2()
    return int(info().fordblks) if info is not None else None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_heap(min_free: int = 0) -> bool:
    """Return the heap's free pages to the OS (glibc ``malloc_trim(0)``).

    Args:
        min_free: do nothing while glibc holds fewer free bytes than this (a trim walks every
            free block, and the pages it returns are faulted in again when reused).

    Returns:
        True when memory was released, False when there was none or the C library has no
        ``malloc_trim``.

    Example::

        >>> release_free_heap() in (True, False)
        True
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    if min_free > 0:
        free = free_heap_bytes()
        if free is not None and free < min_free:
            return False
    return bool(trim(0))


GENERATION_TRIM_AT = 8 * 2**20
"""The free heap a generation keeps at most (:func:`handing_back_heap`): more is handed back after the forward that
freed it. A 4-layer Llama of 2048 wide, 800 new tokens in bnb.int8, kept +19 MiB without, +4 MiB with it, measured
on a 2-core CPU (``benchmarks/generation_growth.py`` measures such runs, with and without the hand-back)."""


@contextlib.contextmanager
def handing_back_heap(module: nn.Module, min_free: int = GENERATION_TRIM_AT) -> Iterator[None]:
    """While the block runs, hand glibc's free heap back after each forward of ``module`` that leaves more than
    ``min_free`` of it.

    A generation's steps free transients that grow with the positions filled (litgpt repeats each key and value head
    for its query heads over the whole cache: 12 MiB a layer at 1,500 positions of a 2048-wide model), and once glibc
    has raised its mmap threshold the next, larger ones come from the heap, whose holes stay resident: RSS grew with
    every token decoded (+18 MiB over 1,500 tokens in bnb.int8, +32 MiB in bnb.nf4). Inside a compiled forward it does
    nothing (a call into the C library there would split the graph).
    """
    def hand_back(_module: nn.Module, _args: Any, _output: Any) -> None:
        if not torch.compiler.is_compiling():
            release_free_heap(min_free)

    handle = module.register_forward_hook(hand_back)
    try:
        yield
    finally:
        handle.remove()


def trim_after_first_forward(module: nn.Module) -> None:
    """Give glibc's free heap back once, right after ``module``'s first forward (idempotent).

    A quantized layer's first forward on CPU leaves freed temporaries resident in the heap:
    bitsandbytes 4-bit repacks its weight for the CPU kernel (an int32 unpacked copy and byte
    copies; pythia-1b nf4 kept +447 MiB over a first forward, +23 MiB trimmed after each layer),
    and int8 layers dequantize or convert theirs (pythia-1b, a 2 x 32 batch: bnb.int8 kept +85 MiB
    and peaked +245 MiB, trimmed +20 and +173 MiB; torchao int8wo +47 and +79 MiB, trimmed +13 and
    +39 MiB). The hook removes itself after one call.
    """
    if "_lowmem_trim_hook" not in module.__dict__:
        module.__dict__["_lowmem_trim_hook"] = module.register_forward_hook(_trim_once)


def _trim_once(module: nn.Module, args: Any, output: Any) -> None:
    release_free_heap()
    handle = module.__dict__.pop("_lowmem_trim_hook", None)
    if handle is not None:
        handle.remove()
