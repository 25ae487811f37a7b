"""A tensor of a torch checkpoint's entries beside the weights (an optimizer's state), left unread until asked for.

``fabric.load`` of one full checkpoint into a sharded model needs only this rank's rows of each optimizer state
tensor (``exp_avg``, ``exp_avg_sq``: each the shape of its parameter). Rebuilding the entries with every tensor read
would hold the whole optimizer state on every rank; an :class:`EntryTensor` stands in its place instead, and is read
whole or a block of rows at a time, as the weights are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EntryTensor:
    """A tensor the pickle describes, not read yet.

    Attributes:
        where: its place in the entries (``"optimizer.state.wte.weight.exp_avg"``), for messages.
        shape, dtype: as ``torch.load`` would give it.
        reader: ``reader(start, stop, out)``: rows ``start:stop`` (all of them: ``0, shape[0]``) into ``out``, or
            into a new tensor when ``out`` is None.
        contiguous: whether its rows lie in the file one after the other (else only whole reads).
    """

    where: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    reader: Callable[[int, int, torch.Tensor | None], torch.Tensor]
    contiguous: bool = True

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def read(self) -> torch.Tensor:
        """The whole tensor, as ``torch.load`` gives it."""
        return self.reader(0, self.shape[0] if self.shape else 1, None)

    def read_rows(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:stop`` (along dim 0), into ``out`` when given."""
        if not self.shape or not 0 <= start <= stop <= self.shape[0]:
            raise IndexError(f"rows {start}:{stop} of {self.where} (shape {self.shape})")
        if not self.contiguous:
            raise ValueError(f"{self.where} is a strided view in its file; read it whole with read().")
        return self.reader(start, stop, out)
