"""DTensor shards in place: this rank's part of each parameter allocated on its own, then filled where it lies.

A model sharded by ``fully_shard`` (FSDP2) on the meta device holds, on each rank, DTensor parameters
whose local part is on meta. :func:`allocate_shards` gives every such part memory on this rank alone
(uninitialised: a load fills it) and keeps the parameter objects: the new local tensor is swapped into
the same ``nn.Parameter`` (``torch.utils.swap_tensors``, as ``nn.Module.to_empty`` does for tensor
subclasses), so ties and optimizers that hold the parameter still do, and FSDP2's own record of the
parameter is pointed at the new storage (padded as FSDP2 pads uneven rows). Nothing else is touched:
buffers built in ``__init__`` (litgpt's RoPE tables) keep their values, where ``to_empty`` would
leave garbage in them. The loader then reads into :func:`local_tensor` of each parameter.

This uses FSDP2's parameter record (``FSDPParam``: ``sharded_param``, ``padded_sharded_param_size``,
``to_sharded_dtensor``, ``reset_sharded_param``), as torch 2.13 names it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_lowmem.meta import empty_like
from lightning_lowmem.plan.dtensor_part import is_dtensor
from lightning_lowmem.quantize import tensor_nbytes
from lightning_lowmem.runtime.execution import mesh_device


class Allocation:
    """The shards :func:`allocate_shards` gave memory; :meth:`undo` puts them back on meta.

    Attributes:
        names: the parameters allocated (one name each).
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        self._undo: list[Callable[[], None]] = []

    def undo(self) -> None:
        for step in reversed(self._undo):
            step()
        self._undo.clear()


def fsdp_params(module: nn.Module) -> dict[int, Any]:
    """``id(parameter) -> FSDPParam`` for every parameter FSDP2 manages in ``module``."""
    found: dict[int, Any] = {}
    for mod in module.modules():
        get_state = getattr(mod, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
        for group in groups:
            for fsdp_param in (group.fsdp_params if group is not None else []):
                found[id(fsdp_param.sharded_param)] = fsdp_param
    return found


def sharded_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """Name -> parameter, for every DTensor parameter of ``module`` (tied ones once, under their first name)."""
    return {name: p for name, p in module.named_parameters() if is_dtensor(p)}


def allocate_shards(module: nn.Module, device: torch.device | None = None,
                    names: set[str] | None = None) -> Allocation:
    """Give each DTensor parameter of ``module`` whose local part is on meta memory on ``device`` (default: its
    device mesh's device on this rank), this rank's part only, uninitialised, keeping the parameter objects and
    FSDP2's record of them.

    Args:
        module: the sharded model.
        device: where the parts go (default: this rank's device of the mesh, ``runtime/rank_device.py``: the one
            its process group is bound to, else ``LOCAL_RANK``'s; never the current device).
        names: only these parameters (default: all).
    """
    allocation = Allocation()
    fsdp = fsdp_params(module)
    for name, param in sharded_parameters(module).items():
        if param.is_meta and (names is None or name in names):
            allocation._undo.append(_allocate(param, fsdp.get(id(param)), device or mesh_device(param.device_mesh)))
            allocation.names.append(name)
    return allocation


def _allocate(param: nn.Parameter, fsdp_param: Any, device: torch.device) -> Callable[[], None]:
    """Swap a real local part into ``param``; returns how to swap the meta one back."""
    meta = param._local_tensor
    padded_size = tuple(fsdp_param.padded_sharded_param_size) if fsdp_param is not None else tuple(meta.shape)
    if padded_size != tuple(meta.shape):  # uneven rows: FSDP2 keeps every rank's part padded to the first's
        padded = torch.empty(padded_size, dtype=meta.dtype, device=device)
        padded[meta.shape[0]:].zero_()
        local = padded.narrow(0, 0, meta.shape[0])
    else:
        local = padded = empty_like(meta, device)
    if fsdp_param is not None:
        dtensor = fsdp_param.to_sharded_dtensor(local)
    else:
        from torch.distributed.tensor import DTensor

        dtensor = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                     shape=param.shape, stride=param.stride())
    other = nn.Parameter(dtensor, requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, other)  # `other` now holds the meta part
    if fsdp_param is None:
        return lambda: torch.utils.swap_tensors(param, other)
    old_data = fsdp_param._sharded_param_data
    fsdp_param._sharded_param_data = padded.view(-1)
    fsdp_param.reset_sharded_param()

    def undo() -> None:
        torch.utils.swap_tensors(param, other)
        fsdp_param._sharded_param_data = old_data

    return undo


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a view of its storage: writing into it fills the parameter)."""
    return tensor._local_tensor


def shard_nbytes(module: nn.Module) -> int:
    """Bytes of this rank's parts of ``module``'s DTensor parameters and buffers (each storage once)."""
    seen: set[tuple[str, int]] = set()
    tensors = [*module.parameters(), *module.buffers()]
    return sum(tensor_nbytes(local_tensor(t), seen) for t in tensors if is_dtensor(t))
