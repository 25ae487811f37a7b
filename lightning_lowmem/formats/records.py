"""What a checkpoint file holds, known from its headers alone (one record per tensor), and how its data is read.

Every reader (``safetensors.py``, ``torch_zip.py``) gives :class:`TensorRecord` s from the
file's headers and reads each tensor, or a block of its rows, on its own
(``files.OpenedFile.read_into``), straight into the memory that becomes the tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch


@dataclass(frozen=True)
class TensorRecord:
    """A tensor in a checkpoint file, described without reading its data.

    Attributes:
        key: the name in the checkpoint (after unwrapping a Lightning ``state_dict``
            or Fabric ``model`` entry, before any key map).
        shape: the tensor's shape.
        dtype: the dtype it is stored in.
        file: the file that holds it.
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
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
    """Byte offset of row ``start`` in a C-contiguous tensor's data, and the shape of rows ``start:stop``.

    Example::

        >>> rec = TensorRecord("w", (10, 4), torch.bfloat16, Path("m.safetensors"))
        >>> row_span(rec, 2, 5)
        (16, (3, 4))
    """
    if not record.shape or not 0 <= start <= stop <= record.shape[0]:
        raise IndexError(f"rows {start}:{stop} of {record.key!r} (shape {record.shape})")
    row_bytes = math.prod(record.shape[1:]) * record.dtype.itemsize
    return start * row_bytes, (stop - start, *record.shape[1:])
