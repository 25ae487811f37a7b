"""What a checkpoint holds, known from its headers alone: one record per tensor."""

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

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """A new CPU tensor with the stored data, sharing memory with nothing else (or ``out``, filled)."""
        ...

    def close(self) -> None: ...
