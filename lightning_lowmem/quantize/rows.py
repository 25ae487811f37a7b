"""Quantizing a weight in blocks of rows, so that its temporaries stay small.

bitsandbytes' CPU quantizers work on a float32 copy of the whole weight and keep
several full-size temporaries: quantizing pythia-1b's 8192 x 2048 MLP weight (32 MiB
in bf16) peaked 235 MiB (nf4) and 160 MiB (int8) above the weight itself. Its schemes
are block-wise (a scale per ``blocksize`` consecutive elements) or row-wise, so
quantizing blocks of rows and concatenating the pieces gives the same bytes as
quantizing the whole weight at once (the tests check this bit for bit against
bitsandbytes' own after-load path), with temporaries the size of one block.

On a device (CUDA) a weight is quantized whole instead (:func:`by_blocks`): its kernels are one call each.

A weight read from the file comes with :class:`~lightning_lowmem.quantize.workers.RowWorkers`: its blocks are
then read and quantized on several threads at once (see ``workers.py``), each holding one block's temporaries.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass

import torch

from lightning_lowmem.quantize.workers import RowWorkers

CHUNK_ELEMENTS = 1 << 19
"""Elements per block of rows (1 MiB of bf16). Loading pythia-1b (bf16 safetensors, 2 cores, two runs each), the
peak above the final model's RSS and the load's seconds were, for blocks of 4 Mi / 1 Mi / 512 Ki / 256 Ki elements:
bnb.nf4 +150 / +55 / +58 / +40 MiB in 17-18 / 14-16 / 14-15 / 14-15 s; bnb.int8 +130 / +62 / +44 / +40 MiB in
7-8 / 4.1-4.7 / 3.5-3.8 / 4.2-4.9 s. Small blocks reuse the same few MiB of heap for their temporaries, where
blocks of 16 MiB and more of float32 get fresh pages each time (a page fault per 4 KiB)."""


def by_blocks(device: torch.device) -> bool:
    """Whether a weight on ``device`` is quantized by blocks of rows: on the CPU (small temporaries that stay in its
    caches, blocks on several threads); on a device, whole: one copy and one kernel call per weight, no
    synchronization between blocks (blocks of 1 MiB on a GPU made 3,344 ``quantize_4bit`` calls and 6,747 stream
    synchronizations for 8 layers of a Llama-3-8B). The bytes are the same either way.

    Example::

        >>> by_blocks(torch.device("cpu")), by_blocks(torch.device("meta"))
        (True, False)
    """
    return device.type == "cpu"


def rows_per_chunk(shape: Sequence[int], align: int = 1, chunk_elements: int | None = None) -> int:
    """Rows per block: about ``chunk_elements`` (default :data:`CHUNK_ELEMENTS`) elements, a multiple of ``align``.

    Example::

        >>> rows_per_chunk((8192, 2048), align=64)
        256
        >>> rows_per_chunk((10, 100), align=64, chunk_elements=1000)  # 16 rows = 1600 elements = 25 blocks
        16
    """
    chunk_elements = CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    cols = math.prod(shape[1:]) or 1
    unit = align // math.gcd(cols, align)  # the fewest rows whose element count is a multiple of align
    return max(unit, (chunk_elements // cols) // unit * unit)


@dataclass(frozen=True)
class RowSource:
    """A 2-D weight handed out a block of rows at a time, so that it never has to exist whole.

    The loader makes one over a checkpoint tensor (each block read from the file, cast and
    moved on its own); :meth:`of` makes one over a tensor already in memory.

    Attributes:
        shape: the whole weight's shape.
        dtype: the dtype of the blocks.
        device: where the blocks are.
        rows: ``rows(start, stop)`` gives rows ``start:stop``. A block may share memory with the previous
            one asked for by the same thread: it must be used before that thread asks for the next. With
            ``workers``, it is called from their threads, several blocks at once.
        workers: the threads that read and quantize its blocks (None: one block at a time, in the caller's).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    rows: Callable[[int, int], torch.Tensor]
    workers: RowWorkers | None = None

    @classmethod
    def of(cls, weight: torch.Tensor) -> RowSource:
        weight = weight.contiguous()
        return cls(tuple(weight.shape), weight.dtype, weight.device, lambda start, stop: weight[start:stop])

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole weight, as ``torch.Tensor.nbytes``."""
        return self.numel * self.dtype.itemsize

    def whole(self) -> torch.Tensor:
        """The whole weight, for a quantizer that cannot work by rows."""
        return self.rows(0, self.shape[0])


def map_rows(weight: torch.Tensor | RowSource, quantize: Callable[[torch.Tensor], Sequence[torch.Tensor]],
             lengths: Sequence[int] | int, align: int = 1, chunk_elements: int | None = None) -> list[torch.Tensor]:
    """``quantize`` blocks of rows of ``weight``, writing each of its outputs into one tensor along dim 0.

    Args:
        weight: a 2-D weight, or a :class:`RowSource` that reads it a block at a time (with its ``workers``:
            several blocks at once, on their threads).
        quantize: returns the tensors that hold a block's quantized data; each must be laid
            out along dim 0 in the order of the block's elements, in memory of its own (not the block's).
        lengths: the dim-0 length of each output for the whole weight (dtype and other dims are
            taken from the first block's outputs); one int: the same for every output.
        align: block boundaries fall on multiples of this many elements (the scheme's blocksize).
        chunk_elements: elements per block (default :data:`CHUNK_ELEMENTS`).

    Returns:
        The outputs for the whole weight: the same as ``quantize(weight)``.
    """
    source = weight if isinstance(weight, RowSource) else RowSource.of(weight)
    rows = source.shape[0]
    step = rows_per_chunk(source.shape, align, chunk_elements)
    if step >= rows or not by_blocks(source.device):
        return list(quantize(source.whole()))
    starts = range(0, rows, step)
    outputs = _Outputs([lengths] if isinstance(lengths, int) else list(lengths), each=isinstance(lengths, int))

    def block(i: int) -> None:
        with torch.no_grad():  # grad mode is per thread: a worker's is not the caller's
            pieces = quantize(source.rows(starts[i], min(starts[i] + step, rows)))
            outputs.put(i, pieces, full=starts[i] + step <= rows)

    blocks = (source.workers.map(block, len(starts)) if source.workers is not None
              else (block(i) for i in range(len(starts))))
    with closing(blocks):  # on an error, the workers' blocks in flight end before it goes on
        for _ in blocks:
            pass
    return outputs.done()


class _Outputs:
    """The outputs of :func:`map_rows`, each block's pieces written into them by the thread that quantized it.

    A block's pieces go at ``index`` times a full block's lengths (every block but the last is full), so they are
    written as they come, in any order, by several threads at once, and never gathered in a list. The outputs are
    allocated when the first full block arrives; a last block that comes before it waits here.
    """

    def __init__(self, lengths: list[int], each: bool) -> None:
        self._lengths, self._each = lengths, each  # each: one length for every output
        self._lock = threading.Lock()
        self._outputs: list[torch.Tensor] = []
        self._full: list[int] = []
        self._early: tuple[int, Sequence[torch.Tensor]] | None = None
        self._filled: list[int] = []

    def put(self, index: int, pieces: Sequence[torch.Tensor], full: bool) -> None:
        with self._lock:
            if not self._outputs:
                if not full:
                    self._early = (index, pieces)
                    return
                lengths = self._lengths * len(pieces) if self._each else self._lengths
                self._outputs = [p.new_empty((n, *p.shape[1:])) for p, n in zip(pieces, lengths, strict=True)]
                self._lengths, self._full, self._filled = lengths, [p.shape[0] for p in pieces], [0] * len(pieces)
            elif full and [p.shape[0] for p in pieces] != self._full:
                raise RuntimeError(f"Block {index} was quantized into {[p.shape[0] for p in pieces]} rows, "
                                   f"the first full block into {self._full}: blocks must be alike.")
            early, self._early = self._early, None
            for i, piece in enumerate(pieces):
                self._filled[i] += piece.shape[0]
        self._write(index, pieces)
        if early is not None:
            self.put(*early, full=False)

    def _write(self, index: int, pieces: Sequence[torch.Tensor]) -> None:
        for output, full, piece in zip(self._outputs, self._full, pieces, strict=True):
            output[index * full:index * full + piece.shape[0]] = piece

    def done(self) -> list[torch.Tensor]:
        """The outputs, once every block was put."""
        if self._early is not None or self._filled != self._lengths:
            raise RuntimeError(f"Quantized blocks filled {self._filled} rows of outputs sized {self._lengths}.")
        return self._outputs
