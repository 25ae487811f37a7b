"""Quantizing a weight in blocks of rows, so that its temporaries stay small.

bitsandbytes' CPU quantizers work on a float32 copy of the whole weight and keep
several full-size temporaries: quantizing pythia-1b's 8192 x 2048 MLP weight (32 MiB
in bf16) peaked 235 MiB (nf4) and 160 MiB (int8) above the weight itself. Its schemes
are block-wise (a scale per ``blocksize`` consecutive elements) or row-wise, so
quantizing blocks of rows and concatenating the pieces gives the same bytes as
quantizing the whole weight at once (the tests check this bit for bit against
bitsandbytes' own after-load path), with temporaries the size of one block.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

CHUNK_ELEMENTS = 1 << 19
"""Elements per block of rows (1 MiB of bf16). Loading pythia-1b (bf16 safetensors, 2 cores, two runs each), the
peak above the final model's RSS and the load's seconds were, for blocks of 4 Mi / 1 Mi / 512 Ki / 256 Ki elements:
bnb.nf4 +150 / +55 / +58 / +40 MiB in 17-18 / 14-16 / 14-15 / 14-15 s; bnb.int8 +130 / +62 / +44 / +40 MiB in
7-8 / 4.1-4.7 / 3.5-3.8 / 4.2-4.9 s. Small blocks reuse the same few MiB of heap for their temporaries, where
blocks of 16 MiB and more of float32 get fresh pages each time (a page fault per 4 KiB)."""


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
        rows: ``rows(start, stop)`` gives rows ``start:stop``. A block may share memory with
            the previous one: it must be used before the next is asked for.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    rows: Callable[[int, int], torch.Tensor]

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
        weight: a 2-D weight, or a :class:`RowSource` that reads it a block at a time.
        quantize: returns the tensors that hold a block's quantized data; each must be laid
            out along dim 0 in the order of the block's elements.
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
    if step >= rows:
        return list(quantize(source.whole()))
    outputs: list[torch.Tensor] = []
    offsets: list[int] = []
    for start in range(0, rows, step):
        pieces = quantize(source.rows(start, min(start + step, rows)))
        if not outputs:  # written into as they come: no list of pieces, no concatenated copy
            if isinstance(lengths, int):
                lengths = [lengths] * len(pieces)
            outputs = [p.new_empty((n, *p.shape[1:])) for p, n in zip(pieces, lengths, strict=True)]
            offsets = [0] * len(outputs)
        for i, piece in enumerate(pieces):
            outputs[i][offsets[i]:offsets[i] + piece.shape[0]] = piece
            offsets[i] += piece.shape[0]
        del pieces
    if offsets != list(lengths):
        raise RuntimeError(f"Quantized blocks filled {offsets} rows of outputs sized {list(lengths)}.")
    return outputs
