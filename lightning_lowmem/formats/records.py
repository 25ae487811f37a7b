"""What a checkpoint file holds, known from its headers alone (one record per tensor), and how its data is read.

Every reader (``safetensors_file.py``, ``torch_zip.py``, ``gguf_file.py``) gives :class:`TensorRecord` s
from the file's headers and reads each tensor, or a block of its rows, on its own
(``files.OpenedFile.read_into``), straight into the memory that becomes the tensor. A GGUF tensor
stored in a quantized block format (``Q4_0``, ``Q8_0``, ...) is dequantized as it is read: its record
says the dtype it is read as and, apart, the bytes the file stores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """A tensor in a checkpoint file, described without reading its data.

    Attributes:
        key: the name in the checkpoint (after unwrapping a Lightning ``state_dict``
            or Fabric ``model`` entry, before any key map).
        shape: the tensor's (logical) shape.
        dtype: the dtype the reader gives it in: the dtype it is stored in, or, for a tensor stored
            in a block format, the dtype it is dequantized to (float32).
        file: the file that holds it.
        encoding: the block format the file stores it in (a GGUF type such as ``"Q4_0"``), or None
            when it is stored plainly as ``dtype``.
        stored_nbytes: the bytes the file stores for it when ``encoding`` is set.
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path
    encoding: str | None = None
    stored_nbytes: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes read from the file for this tensor: what the file stores (quantized bytes for an encoded one)."""
        return self.stored_nbytes if self.stored_nbytes is not None else self.tensor_nbytes

    @property
    def tensor_nbytes(self) -> int:
        """Bytes of the tensor as the reader gives it (``shape`` x ``dtype``: dequantized for an encoded one).

        Example::

            >>> rec = TensorRecord("w", (64, 32), torch.float32, Path("m.gguf"), "Q8_0", 64 * 34)
            >>> rec.nbytes, rec.tensor_nbytes
            (2176, 8192)
        """
        return self.numel * self.dtype.itemsize


class CheckpointFile(Protocol):
    """One file of a checkpoint: its records, and a way to read each tensor on its own."""

    path: Path

    def records(self) -> dict[str, TensorRecord]: ...

    def metadata(self) -> dict[str, str]:
        """Text the file keeps beside its tensors (a safetensors header's ``__metadata__``)."""
        ...

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """A new CPU tensor with the stored data, sharing memory with nothing else (or ``out``, filled)."""
        ...

    def map(self, key: str) -> torch.Tensor | None:
        """``key`` over the file's mapped pages, not read; None when it cannot be mapped."""
        ...

    def reads_rows(self, key: str) -> bool:
        """Whether :meth:`read_rows` can read a block of rows of ``key`` without reading the rest."""
        ...

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:stop`` (along dim 0) of ``key``, as :meth:`read` would give them."""
        ...

    def check_unchanged(self) -> None:
        """Raise when the file changed since it was opened."""
        ...

    def close(self) -> None: ...


def row_span(record: TensorRecord, start: int, stop: int) -> tuple[int, tuple[int, ...]]:
    """Byte offset of row ``start`` in a C-contiguous tensor's stored data, and the shape of rows ``start:stop``.

    An encoded tensor stores each row (along dim 0) as a whole number of blocks, so its rows are
    ``stored_nbytes / shape[0]`` bytes each.

    Example::

        >>> rec = TensorRecord("w", (10, 4), torch.bfloat16, Path("m.safetensors"))
        >>> row_span(rec, 2, 5)
        (16, (3, 4))
        >>> row_span(TensorRecord("w", (10, 64), torch.float32, Path("m.gguf"), "Q8_0", 10 * 68), 2, 5)
        (136, (3, 64))
    """
    if not record.shape or not 0 <= start <= stop <= record.shape[0]:
        raise IndexError(f"rows {start}:{stop} of {record.key!r} (shape {record.shape})")
    row_bytes = record.nbytes // record.shape[0] if record.shape[0] else 0
    return start * row_bytes, (stop - start, *record.shape[1:])
