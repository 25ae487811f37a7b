"""Device budgets: ``max_memory={"cuda:0": "6GiB", "cpu": "20GiB"}`` read once, checked, ordered.

At most one accelerator (the *execution device*, where every layer runs) and the CPU
(where layers that do not fit are kept and streamed in from). Integer keys are CUDA
indices, as accelerate spells them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lightning_lowmem.errors import format_names
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
        TypeError: ``max_memory`` is not a mapping, a key is neither a device name nor a CUDA index, or a size
            neither an int nor a str.
        ValueError: no budget, a key that names no device (``"gpu"``, ``"disk"``, ``-1``) or the meta device, one
            device twice, more than one accelerator, or a size that cannot be read or is below 0.

    Example::

        >>> parse_max_memory({0: "6GiB", "cpu": "20GiB"}).execution_device
        'cuda:0'
        >>> parse_max_memory({"cpu": 2**30})
        Budgets(bytes={'cpu': 1073741824}, execution_device='cpu', offload_device=None)
    """
    if isinstance(max_memory, Budgets):
        return max_memory
    if not isinstance(max_memory, Mapping):
        raise TypeError(f"max_memory must be a dict of device -> size, e.g. {{'cuda:0': '6GiB', 'cpu': '20GiB'}}, "
                        f"got {type(max_memory).__name__} {max_memory!r}.")
    budgets: dict[str, int] = {}
    for key, value in max_memory.items():
        device = str(_budget_device(key))
        if device in budgets:
            raise ValueError(f"max_memory names {device} twice ({format_names(map(str, max_memory))}): give each "
                             "device one budget.")
        budgets[device] = parse_bytes(value, name=f"max_memory[{key!r}]")
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


def _budget_device(key: object) -> torch.device:
    """The device a ``max_memory`` key names: a device string, or an int CUDA index; a bare ``cuda`` is ``cuda:0``."""
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise TypeError(f"max_memory's keys must be device names ('cpu', 'cuda:0') or CUDA indices (0), got "
                        f"{key!r}.")
    try:
        device = torch.device(f"cuda:{key}" if isinstance(key, int) else key)
    except (RuntimeError, ValueError) as e:
        disk = " Layers that fit no budget stay in the checkpoint file with disk_offload=True." if key == "disk" else ""
        raise ValueError(f"max_memory names {key!r}, which is no device: use 'cpu', 'cuda', 'cuda:N' or an int N "
                         f"(cuda:N), e.g. max_memory={{'cuda:0': '6GiB', 'cpu': '20GiB'}}.{disk}") from e
    if device.type == "meta":
        raise ValueError("max_memory names 'meta', which holds no data: budget the devices the layers run on "
                         "('cuda:0', 'cpu').")
    return torch.device("cuda", 0) if device.type == "cuda" and device.index is None else device
