"""Sums agreed across the ranks that hold rows of one weight, for a scheme that quantizes each rank's own rows.

NF4 needs one number of the whole weight, the mean of its block maxima (``quantize/nf4.py``): each rank sums
its own and one all-reduce per weight, on the process group of the mesh dimension the weight is cut along,
adds them up. That all-reduce is a point where the ranks wait for each other in the middle of the stream: it is
also the ranks' failure check (:func:`~lightning_lowmem.ranks.agreement.checked_sum`), so that a rank whose load
failed before it (gone to the agreement at the end of the stream) meets the others there, and every rank raises
that rank's error (``ranks/agreement.py``) instead of waiting for a rank that will never come. One collective
and one read of its failure flag on the host per weight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_lowmem.ranks.agreement import checked_sum
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
        param = self.module.get_parameter(target.names[0])  # a quantized weight: a parameter
        dim = next(i for i, p in enumerate(param.placements) if p.is_shard())
        total = checked_sum(value, param.device_mesh.get_group(dim),
                            f"summing {target.names[0]!r}'s NF4 block scales across its ranks")
        self.calls += 1
        return total
