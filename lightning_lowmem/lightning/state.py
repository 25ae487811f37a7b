"""Lightning's objects around a model that is still on meta or was just streamed in.

Shared by the Fabric strategy and the Trainer callback: moving a half-built model
to its device, the dtype a precision plugin stands for, re-pointing optimizers at
the loaded parameters, and a checkpoint's entries beside the weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer

from lightning_lowmem.dtypes import PRECISION_DTYPES
from lightning_lowmem.errors import UnsafeCheckpointError, format_names
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.meta import has_meta


def module_to_device_skipping_meta(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for every tensor that has data; meta tensors stay where they are.

    A plain ``.to()`` fails on meta ("Cannot copy out of meta tensor"). Subtrees with no meta
    tensor go through their own ``.to()``, so quantized modules (bitsandbytes) move their
    quantization state along with the weight.
    """
    if not has_meta(module):
        module.to(device)
        return
    for child in module.children():
        module_to_device_skipping_meta(child, device)
    for param in module._parameters.values():
        if param is not None and not param.is_meta and param.device != device:
            param.data = param.data.to(device)  # same Parameter object: optimizers keep pointing at it
    for name, buf in module._buffers.items():
        if buf is not None and not buf.is_meta and buf.device != device:
            module._buffers[name] = buf.to(device)


def plugin_dtype(precision: object) -> torch.dtype | None:
    """The dtype a "-true" precision plugin converts modules to; None for 32-true and mixed precision.

    Fabric's and the Trainer's ``HalfPrecision`` (``"bf16-true"``, ``"16-true"``) keep it in
    ``_desired_input_dtype``; ``DoublePrecision`` (``"64-true"``) converts to float64.
    """
    dtype = getattr(precision, "_desired_input_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    if type(precision).__name__ == "DoublePrecision":
        return PRECISION_DTYPES["64-true"]
    return None


def remap_optimizer_params(optimizers: Iterable[Optimizer], before: dict[str, nn.Parameter],
                           after: dict[str, nn.Parameter]) -> int:
    """Point optimizers built on the meta parameters ``before`` at the loaded ones ``after``.

    Loading replaces a meta parameter by a new ``nn.Parameter`` (a quantized module even by a
    new module); an optimizer made before the load would hold the meta ones and train nothing.
    Matching is by name. Returns how many references were changed.
    """
    new_by_old = {id(old): after[name] for name, old in before.items() if name in after and after[name] is not old}
    changed = 0
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            params = [new_by_old.get(id(p), p) for p in group["params"]]
            changed += sum(a is not b for a, b in zip(params, group["params"]))
            group["params"] = params
        for old_id, new in new_by_old.items():  # state keyed by a replaced parameter (rare before a load)
            for param in list(optimizer.state):
                if id(param) == old_id:
                    optimizer.state[new] = optimizer.state.pop(param)
    return changed


def weights_key(ckpt: Checkpoint, state: Mapping[str, Any]) -> str | None:
    """The key of ``state`` whose module takes the checkpoint's weights: the entry they were found under
    (``model``, ``state_dict``) when ``state`` holds a module there; for a bare state dict (safetensors,
    ``lit_model.pth``), ``state``'s one module; else None."""
    if ckpt.entry:
        return ckpt.entry if isinstance(state.get(ckpt.entry), nn.Module) else None
    modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
    return modules[0] if len(modules) == 1 else None


def restore_entries(state: dict[str, Any], rest: dict[str, Any], key: str | None, strict: bool,
                    load_optimizer: Callable[[Optimizer, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Restore each entry of ``state`` but the weights' (``key``) from the checkpoint's ``rest``, as Lightning's
    ``fabric.load`` does (modules, stateful objects, plain values; optimizers by ``load_optimizer`` when given, else
    as stateful objects); returns what ``state`` did not ask for."""
    for name, obj in state.copy().items():
        if name == key or name not in rest:
            continue
        if load_optimizer is not None and isinstance(obj, Optimizer):
            load_optimizer(obj, rest.pop(name))
        elif isinstance(obj, nn.Module):
            obj.load_state_dict(rest.pop(name), strict=strict, assign=has_meta(obj))
        elif isinstance(obj, _Stateful):
            obj.load_state_dict(rest.pop(name))
        else:
            state[name] = rest.pop(name)
    return rest


def other_entries(ckpt: Checkpoint, requested: Mapping[str, Any], weights_only: bool | None,
                  unread: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A checkpoint's entries beside the weights (optimizer state, counters), for ``fabric.load``.

    They come from the pickle the plan was made from, without reading the weights; entries holding
    objects lightning_lowmem does not build (a LightningModule's hyper-parameters of any class) are
    left out, with a warning naming them. ``weights_only=False``, Lightning's and torch's "I trust
    this file", unpickles them as ``torch.load`` does, running what the file asks for.

    The tensors of the entries named in ``unread`` are left unread (``EntryTensor`` handles), to be read as needed
    (a sharded optimizer's: each rank its part).

    Raises:
        UnsafeCheckpointError: an entry named in ``requested`` holds such objects and ``weights_only`` is not False.
    """
    rest, not_built = ckpt.other_entries(unread)
    if not not_built:
        return rest
    if weights_only is False and len(ckpt.paths) == 1:
        return _trusted_entries(ckpt, rest)
    entries = sorted({path.split(".")[0].split("[")[0] for path in not_built})
    asked = [name for name in entries if name in requested]
    advice = ("Pass weights_only=False to fabric.load if you trust the file: its objects are then built as torch.load "
              "builds them, which runs code the file names.")
    if asked:
        raise UnsafeCheckpointError(
            f"{ckpt.description}: the entries {format_names(asked)} you asked to restore hold objects that "
            f"lightning_lowmem does not build ({format_names(not_built)}); nothing was run. {advice}")
    rank_zero_warn(f"{ckpt.description}: not restored: {format_names(entries)}, which hold objects lightning_lowmem "
                   f"does not build ({format_names(not_built)}); nothing was run. {advice}")
    return {name: value for name, value in rest.items() if name not in entries}


def _trusted_entries(ckpt: Checkpoint, rest: dict[str, Any]) -> dict[str, Any]:
    """The other entries unpickled by ``torch.load(weights_only=False)``: mapped, the weights never touched."""
    full = torch.load(ckpt.paths[0], mmap=True, map_location="cpu", weights_only=False)
    kept = {name: full[name] for name in rest if name in full}
    return apply_to_collection(kept, torch.Tensor, lambda t: t.clone())  # no mapping outlives this call
