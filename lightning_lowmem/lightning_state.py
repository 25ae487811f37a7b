"""Lightning state around a model that is still on meta or was just streamed in.

Shared by the Fabric strategy and the Trainer callback: moving a half-built
model to its device, the dtype a precision plugin stands for, re-pointing
optimizers at loaded parameters, and reading a checkpoint's non-weight entries
(optimizer state, counters) without reading its weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import nn
from torch.optim import Optimizer

from lightning_lowmem.checkpoint import resolve_files, sniff


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


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


def precision_dtype(precision: object) -> torch.dtype | None:
    """The dtype a "-true" precision plugin converts modules to; None for 32-true and mixed precision.

    Fabric's and the Trainer's ``HalfPrecision`` (``"bf16-true"``, ``"16-true"``) keep it in
    ``_desired_input_dtype``; ``DoublePrecision`` (``"64-true"``) converts to float64.
    """
    dtype = getattr(precision, "_desired_input_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    if type(precision).__name__ == "DoublePrecision":
        return torch.float64
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


def load_other_entries(path: str | Path, skip: str | None, weights_only: bool | None) -> dict[str, Any]:
    """The entries of a torch checkpoint file other than ``skip`` (the weights), read without the weights.

    The file is memory-mapped, so the weights under ``skip`` are never read; the tensors kept
    (optimizer state) are copied out so that no mapping outlives this call.
    """
    files = resolve_files(path)
    if len(files) != 1 or sniff(files[0]) != "torch":
        return {}
    checkpoint = torch.load(files[0], mmap=True, map_location="cpu", weights_only=weights_only)
    if not isinstance(checkpoint, dict):
        return {}
    checkpoint.pop(skip, None)
    return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.clone())
