"""Which part of a tensor this rank holds, when the module's tensor is a DTensor (FSDP2, tensor parallelism).

A DTensor's placements say how the whole tensor is cut across the ranks of its device mesh; this rank
holds one box of it (``torch.distributed.tensor``'s own ``compute_local_shape_and_global_offset``, the
rule ``fully_shard`` and ``distribute_tensor`` cut by). When the box spans every column, it is a block of
rows, which the loader reads from the file on its own; any other box is cut out of the whole tensor.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    """This rank's box of a tensor of ``shape``: ``offset`` and ``local_shape`` along each dimension.

    Attributes:
        shape: the whole tensor's shape.
        offset: where the box starts, per dimension.
        local_shape: the box's shape (0 rows: this rank holds none of it).
        index, count: for a plain cut by rows (``Shard(0)`` on one mesh dimension, ``Replicate`` on the
            others): which of how many ``torch.chunk`` pieces this is; ``(0, 1)`` otherwise.

    Example::

        >>> shard = Shard((5, 4), (3, 0), (2, 4), index=1, count=2)  # rows 3:5 of 5 on rank 1 of 2
        >>> shard.rows, shard.region, shard.fraction
        ((3, 5), (slice(3, 5, None), slice(0, 4, None)), 0.4)
    """

    shape: tuple[int, ...]
    offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    index: int = 0
    count: int = 1

    @property
    def rows(self) -> tuple[int, int] | None:
        """``(start, stop)`` when the box is a block of whole rows, else None."""
        if not self.shape or self.local_shape[1:] != self.shape[1:]:
            return None
        return self.offset[0], self.offset[0] + self.local_shape[0]

    @property
    def region(self) -> tuple[slice, ...]:
        """The box as an index into the whole tensor."""
        return tuple(slice(o, o + n) for o, n in zip(self.offset, self.local_shape, strict=True))

    @property
    def fraction(self) -> float:
        """The box's share of the whole tensor's elements."""
        whole = math.prod(self.shape)
        return math.prod(self.local_shape) / whole if whole else 0.0


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (a DTensor exists only once that module
    is imported, so this imports nothing)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def shard_of(tensor: torch.Tensor) -> Shard | None:
    """This rank's :class:`Shard` of ``tensor`` when it is a DTensor, else None."""
    if not is_dtensor(tensor):
        return None
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as ShardPlacement
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = tensor.device_mesh, tensor.placements
    local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    cuts = [dim for dim, p in enumerate(placements) if not isinstance(p, Replicate)]
    index, count = 0, 1
    if len(cuts) == 1 and placements[cuts[0]] == ShardPlacement(0):
        index, count = mesh.get_local_rank(cuts[0]), mesh.size(cuts[0])
    return Shard(tuple(tensor.shape), tuple(offset), tuple(local_shape), index, count)
