"""Sums agreed across the ranks that hold rows of one weight, for a scheme that quantizes each rank's own rows.

NF4 needs one number of the whole weight, the mean of its block maxima (``quantize/nf4.py``): each rank sums
its own and one all-reduce per weight, on the process group of the mesh dimension the weight is cut along,
adds them up. That all-reduce is a point where the ranks wait for each other in the middle of the stream,
so it also carries whether a rank failed: a rank whose load fails before a weight's all-reduce still makes
that call, with its failure marked (:meth:`ShardSums.abandon`), and every rank of the group raises there,
at the same weight, instead of waiting for a rank that will never come.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_lowmem.errors import LowMemError
from lightning_lowmem.plan import Target


class RankFailedError(LowMemError):
    """Another rank's load failed while this one streamed; this rank stopped at the same weight (its own error is
    raised on that rank)."""


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
        self.peer_failed = False

    def sum_across(self, target: Target) -> Callable[[torch.Tensor], torch.Tensor]:
        """``fn(value)``: ``value`` (a scalar) summed over the ranks holding ``target``'s other rows."""
        def total(value: torch.Tensor) -> torch.Tensor:
            return self._all_reduce(target, value, failed=False)

        return total

    def abandon(self, error: BaseException) -> None:
        """This rank failed with ``error``: make its next all-reduce, if one is left, marked failed, so that the
        other ranks raise there too (nothing when the failure came from another rank)."""
        if self.peer_failed or isinstance(error, RankFailedError) or self.calls >= len(self.targets):
            return
        target = self.targets[self.calls]
        try:
            self._all_reduce(target, torch.zeros((), dtype=torch.float64), failed=True)
        except RankFailedError:
            pass

    def _all_reduce(self, target: Target, value: torch.Tensor, failed: bool) -> torch.Tensor:
        import torch.distributed as dist

        param = self.module.get_parameter(target.names[0])  # a quantized weight: a parameter
        mesh = param.device_mesh
        dim = next(i for i, p in enumerate(param.placements) if p.is_shard())
        local = param._local_tensor
        both = torch.stack([value.to(torch.float64).reshape(()).cpu(), torch.tensor(float(failed), dtype=torch.float64)])
        both = both.to(local.device)  # NCCL reduces device tensors
        dist.all_reduce(both, group=mesh.get_group(dim))
        self.calls += 1
        if not failed and both[1].item() > 0:
            self.peer_failed = True
            raise RankFailedError(
                f"{int(both[1].item())} other rank(s) failed while loading, before quantizing "
                f"{target.names[0]!r}; this rank stopped there too. The failing rank raises the cause.")
        return both[0]
