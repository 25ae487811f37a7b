"""Transforms that may rewrite a tensor a block of rows at a time.

``load_checkpoint(transform=fn)`` calls ``fn(module_name, tensor)`` on each tensor as it is read:
for a plain function the whole tensor, which must then be read whole. A :class:`RowTransform` says
also, per tensor, which blocks of rows it may be applied to on their own (Llama's q and k rows,
stored permuted head by head in a GGUF file, are un-permuted one head at a time), so the loader can
read, rewrite, cast and store such a tensor a block of rows at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowTransform:
    """A transform for ``load_checkpoint(transform=...)`` that tells the loader which rows go together.

    Attributes:
        fn: ``fn(module_name, tensor) -> tensor``: the whole tensor, or a block of its rows, rewritten.
        rows: ``rows(module_name)``: 0 when ``fn`` leaves that tensor as it is; ``n`` when it may be given any
            block of rows that starts and ends on a multiple of ``n`` rows; None when only the whole tensor.

    Example (rows rewritten in pairs)::

        >>> swap = RowTransform(lambda name, t: t.view(-1, 2, *t.shape[1:]).flip(1).reshape(t.shape),
        ...                     lambda name: 2 if name == "w" else 0)
        >>> swap("w", torch.arange(4.0)).tolist(), row_block(swap, "w"), row_block(swap, "b")
        ([1.0, 0.0, 3.0, 2.0], 2, 0)
        >>> row_block(lambda name, t: t, "w") is None  # a plain function: the whole tensor
        True
    """

    fn: Callable[[str, torch.Tensor], torch.Tensor]
    rows: Callable[[str], int | None]

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return self.fn(name, tensor)


def row_block(transform: Callable[[str, torch.Tensor], torch.Tensor] | None, name: str) -> int | None:
    """How ``transform`` applies to module tensor ``name`` by blocks of rows: 0 (it does not touch it, or there is no
    transform), ``n`` (blocks of a multiple of ``n`` rows), None (only the whole tensor: any plain function)."""
    if transform is None:
        return 0
    if isinstance(transform, RowTransform):
        return transform.rows(name)
    return None
