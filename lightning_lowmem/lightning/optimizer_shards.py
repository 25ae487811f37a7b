"""A full checkpoint's optimizer state given to a sharded model's optimizer, each rank reading only its part.

``fabric.save(path, state)`` with ``save_distributed_checkpoint=False`` writes one file holding the whole optimizer
state (torch's ``get_optimizer_state_dict(full_state_dict=True)``: state keyed by parameter name), and a plain
optimizer's ``state_dict()`` keys it by position. Lightning's ``ModelParallelStrategy`` loads the whole file on every
rank and broadcasts each state tensor from rank 0 (``set_optimizer_state_dict(broadcast_from_rank0=True)``): every
rank holds the whole optimizer state for a while. Here the entries are left unread
(:class:`~lightning_lowmem.formats.entry_tensor.EntryTensor`) and each state tensor the shape of its parameter is read
as that parameter's own part on this rank (its rows, as the weights are read; a part cut otherwise: read whole, the
part kept), into the optimizer's own state tensor when it has one already; the rest (``step``, scalars) read whole.
A rank then holds its parameter shard, its optimizer shard and at most one tensor in flight.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_lowmem.formats.entry_tensor import EntryTensor
from lightning_lowmem.plan.dtensor_part import is_dtensor, shard_of


def load_optimizer_shards(model: nn.Module, optimizer: Optimizer, saved: Mapping[str, Any]) -> None:
    """Restore ``optimizer`` (set up on ``model``'s parameters, DTensors or not) from a full optimizer state dict
    whose tensors may be :class:`EntryTensor` handles; each is read as this rank's part of its parameter.

    Raises:
        ValueError: the saved state has another number of parameter groups, or of parameters in a group, or names
            parameters ``model`` does not have.
    """
    names = _names(model)
    state, groups = saved.get("state", {}), saved.get("param_groups", [])
    by_position = [name for p in model.parameters() for name in names[id(p)][:1]]
    if state and isinstance(next(iter(state)), int):  # a plain optimizer's state dict: as Lightning re-keys it
        state = {by_position[i]: v for i, v in state.items()}
        groups = [{**g, "params": [by_position[i] for i in g["params"]]} for g in groups]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"The checkpoint's optimizer state has {len(groups)} parameter groups, the optimizer "
                         f"{len(optimizer.param_groups)}: build the optimizer as it was when the checkpoint was saved.")
    native_state: dict[int, dict[str, Any]] = {}
    native_groups: list[dict[str, Any]] = []
    index = 0
    for group, saved_group in zip(optimizer.param_groups, groups, strict=True):
        _check_group(group, saved_group, names)
        ids = []
        for param in group["params"]:
            entry = next((state[n] for n in names.get(id(param), ()) if n in state), None)
            if entry is not None:
                own = optimizer.state.get(param, {})
                native_state[index] = {k: _part(v, param, own.get(k)) for k, v in entry.items()}
            ids.append(index)
            index += 1
        native_groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": native_state, "param_groups": native_groups})


def _names(model: nn.Module) -> dict[int, list[str]]:
    """``id(parameter) -> its names`` (tied parameters: every name, the first one first)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def _check_group(group: dict[str, Any], saved_group: Mapping[str, Any], names: dict[int, list[str]]) -> None:
    saved_names = list(saved_group.get("params", []))
    if len(saved_names) != len(group["params"]):
        raise ValueError(f"A parameter group of the checkpoint's optimizer state holds {len(saved_names)} "
                         f"parameters, the optimizer's {len(group['params'])}: build the optimizer over the "
                         "parameters it was saved with.")
    known = {n for p in group["params"] for n in names.get(id(p), ())}
    unknown = [n for n in saved_names if isinstance(n, str) and n not in known]
    if unknown:
        raise ValueError(f"The checkpoint's optimizer state names parameters this optimizer's group does not hold: "
                         f"{unknown[:10]}{' ...' if len(unknown) > 10 else ''}. Load it into the model and optimizer "
                         "it was saved from.")


def _part(value: Any, param: torch.Tensor, own: torch.Tensor | None) -> Any:
    """``value`` as this rank's optimizer holds it: a state tensor the shape of a DTensor ``param`` as a DTensor of
    this rank's part (read into ``own``'s local tensor when it fits), any other tensor read whole."""
    entry = isinstance(value, EntryTensor)
    if not entry and (not isinstance(value, torch.Tensor) or is_dtensor(value)):
        return value
    if not is_dtensor(param) or tuple(value.shape) != tuple(param.shape) or not value.shape:
        return value.read() if entry else value
    if not entry:  # read whole already (a file whose entries torch.load built): this rank's part copied out
        value = EntryTensor("", tuple(value.shape), value.dtype, lambda start, stop, out, t=value: t[start:stop])
    from torch.distributed.tensor import DTensor

    shard = shard_of(param)
    local = own._local_tensor if is_dtensor(own) else None
    if local is None or tuple(local.shape) != shard.local_shape or local.dtype != value.dtype:
        local = torch.empty(shard.local_shape, dtype=value.dtype, device=param._local_tensor.device)
    rows = shard.rows
    if rows is not None and value.contiguous:
        if rows[1] > rows[0]:
            direct = local.device.type == "cpu" and local.is_contiguous()
            got = value.read_rows(*rows, out=local if direct else None)
            if got.data_ptr() != local.data_ptr():
                local.copy_(got)
    else:  # a part cut by columns: the whole tensor read, this rank's box kept
        local.copy_(value.read()[shard.region])
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())
