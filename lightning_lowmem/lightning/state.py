"""Lightning's objects around a model that is still on meta or was just streamed in.

Shared by the Fabric strategy and the Trainer callback: moving a half-built model
to its device, the dtype a precision plugin stands for, and re-pointing
optimizers at the loaded parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_lowmem.dtypes import PRECISION_DTYPES
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
