"""Sums agreed across the ranks that hold rows of one weight, for a scheme that quantizes each rank's own rows.

NF4 needs one number of the whole weight, the mean of its block maxima (``quantize/nf4.py``): each rank sums
its own and one all-reduce per weight, on the process group of the mesh dimension the weight is cut along,
adds them up. That all-reduce is a point where the ranks wait for each other in the middle of the stream:
it is preceded by :func:`~lightning_lowmem.ranks.agreement.check_peers`, so that a rank whose load failed before
it (gone to the agreement at the end of the stream) meets the others there, and every rank raises that
rank's error (``ranks/agreement.py``) instead of waiting for a rank that will never come.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_lowmem.ranks.collectives import collective, collective_device
from lightning_lowmem.ranks.agreement import check_peers
from lightning_lowmem.plan import Target


class ShardSums:
    """The all-reduces of one load's weights quantized from each rank's own rows, in the order the stream meets them.

    Args:
        module: the sharded module (its DTensors give each weight's mesh and process group).
        targets: the targets that take one all-reduce each, in stream order (the same on every rank).
    """

    def __init__(self, module: nn.Module, targets: Sequence[Target]) -> None:
        self.module = module
        self.targets = list(targets)
        self.calls = 0  # all-reduces made so far

    def sum_across(self, target: Target) -> Callable[[torch.Tensor], torch.Tensor]:
        """``fn(value)``: ``value`` (a scalar) summed over the ranks holding ``target``'s other rows."""
        def total(value: torch.Tensor) -> torch.Tensor:
            return self._all_reduce(target, value)

        return total

    def _all_reduce(self, target: Target, value: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        param = self.module.get_parameter(target.names[0])  # a quantized weight: a parameter
        mesh = param.device_mesh
        dim = next(i for i, p in enumerate(param.placements) if p.is_shard())
        group = mesh.get_group(dim)
        total = value.to(torch.float64).reshape(()).to(collective_device(group))  # NCCL reduces device tensors
        check_peers()  # a rank that failed earlier is in the stream's agreement, not in this all-reduce
        with collective(f"summing {target.names[0]!r}'s NF4 block scales across its ranks"):
            dist.all_reduce(total, group=group)
        self.calls += 1
        return total.to(value.device)
