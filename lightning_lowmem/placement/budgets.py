"""Device budgets: ``max_memory={"cuda:0": "6GiB", "cpu": "20GiB"}`` read once, checked, ordered.

At most one accelerator (the *execution device*, where every layer runs) and the CPU
(where layers that do not fit are kept and streamed in from). Integer keys are CUDA
indices, as accelerate spells them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lightning_lowmem.memory.units import parse_bytes

MaxMemory = Mapping[str | int, int | str]
HOST = "cpu"


@dataclass(frozen=True)
class Budgets:
    """Parsed ``max_memory``.

    Attributes:
        bytes: device -> bytes allowed, execution device first.
        execution_device: where every layer runs.
        offload_device: ``'cpu'`` when layers may be offloaded there, else None.
    """

    bytes: dict[str, int]
    execution_device: str
    offload_device: str | None


def parse_max_memory(max_memory: MaxMemory | Budgets) -> Budgets:
    """``{"cuda:0": "6GiB", "cpu": "20GiB"}`` as :class:`Budgets`.

    Raises:
        ValueError: no budget, more than one accelerator, or a size that cannot be read.

    Example::

        >>> parse_max_memory({0: "6GiB", "cpu": "20GiB"}).execution_device
        'cuda:0'
        >>> parse_max_memory({"cpu": 2**30})
        Budgets(bytes={'cpu': 1073741824}, execution_device='cpu', offload_device=None)
    """
    if isinstance(max_memory, Budgets):
        return max_memory
    budgets: dict[str, int] = {}
    for key, value in max_memory.items():
        device = torch.device(f"cuda:{key}" if isinstance(key, int) else key)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", 0)
        budgets[str(device)] = parse_bytes(value)
    accelerators = [d for d in budgets if d != HOST]
    if len(accelerators) > 1:
        raise ValueError(f"max_memory names {len(accelerators)} accelerators ({', '.join(accelerators)}); layers "
                         "are placed on one accelerator and offloaded to the CPU. Keep one accelerator and 'cpu'.")
    if not budgets:
        raise ValueError("max_memory is empty: give a budget per device, e.g. {'cuda:0': '6GiB', 'cpu': '20GiB'}.")
    if accelerators:
        execution = accelerators[0]
        ordered = {execution: budgets[execution]} | ({HOST: budgets[HOST]} if HOST in budgets else {})
        return Budgets(ordered, execution, HOST if HOST in budgets else None)
    return Budgets(budgets, HOST, None)
