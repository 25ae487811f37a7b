"""This rank's device: where the tensors of the library's collectives go, and a DTensor's shards on this rank
(``execution.py`` answers with these).

::

    device_type_for(backend)     the device type a process group with ``backend`` reduces the library's tensors on
    collective_device(group)     the CPU where one of the group's backends takes CPU tensors (gloo, a mixed
                                 "cpu:gloo,cuda:nccl" group: a few bytes made on the CPU), else this rank's device
    mesh_device(mesh)            the CPU for a CPU mesh, else this rank's device
    device_index(kind, bound, local_rank, count)
                                 which device of ``kind`` is this rank's: the one its process group is bound to
                                 (``init_process_group(device_id=...)``: Lightning passes it), else ``LOCAL_RANK``'s
                                 (torchrun sets it), else the only one there is

Never the current device (``torch.cuda.current_device()``): a torchrun script that never calls ``set_device`` has
every rank there on device 0, and NCCL would put every rank's tensors on one GPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def device_type_for(backend: str) -> str:
    """The device type a process group with ``backend`` reduces the library's tensors on.

    Args:
        backend: what ``torch.distributed.get_backend(group)`` reports: one backend (``"gloo"``, ``"nccl"``) or
            ``device:backend`` pairs (``"cpu:gloo,cuda:nccl"``, as ``init_process_group()`` makes on a CUDA build).

    Raises:
        ValueError: a backend torch does not know (it registers each backend's devices).

    Example::

        >>> device_type_for("nccl"), device_type_for("gloo"), device_type_for("cpu:gloo,cuda:nccl")
        ('cuda', 'cpu', 'cpu')
    """
    import torch.distributed as dist

    devices: list[str] = []
    for part in (p.strip().lower() for p in backend.split(",") if p.strip()):
        if ":" in part:
            devices.append(part.split(":", 1)[0])
            continue
        known = dist.Backend.backend_capability.get(part)
        if not known:
            raise ValueError(f"Process group backend {part!r} (of {backend!r}) is not one torch knows the devices of "
                             f"({', '.join(sorted(dist.Backend.backend_capability))}); register it with "
                             "torch.distributed.Backend.register_backend(..., devices=[...]).")
        devices += known
    if not devices:
        raise ValueError(f"Process group backend {backend!r} names no backend.")
    return "cpu" if "cpu" in devices else devices[0]


def device_index(kind: str, bound: torch.device | None, local_rank: str | None, count: int) -> int:
    """Which of the ``count`` devices of ``kind`` this process sees is this rank's: ``bound`` (the device its process
    group is bound to), else device ``local_rank`` (``LOCAL_RANK``), else the only one.

    Raises:
        ValueError: none of these tells (several devices, no bound group, no ``LOCAL_RANK``), or ``LOCAL_RANK`` names
            a device this process does not see.

    Example::

        >>> device_index("cuda", None, "3", 8), device_index("cuda", torch.device("cuda", 1), "3", 8)
        (3, 1)
        >>> device_index("cuda", None, "3", 1)  # one device visible to each rank (CUDA_VISIBLE_DEVICES)
        0
    """
    if bound is not None and bound.type == kind and bound.index is not None:
        return bound.index
    if count == 1:
        return 0
    if local_rank is not None and local_rank.strip().isdigit() and int(local_rank) < count:
        return int(local_rank)
    seen = f"LOCAL_RANK={local_rank}" if local_rank is not None else "no LOCAL_RANK"
    raise ValueError(
        f"This rank's {kind} device is not known: its process group is bound to none, {seen}, and this process sees "
        f"{count} {kind} devices. Bind the group to the rank's device (torch.distributed.init_process_group(..., "
        f"device_id=torch.device('{kind}', local_rank)), as Lightning does), or start the ranks with torchrun (it sets "
        "LOCAL_RANK).")


def rank_device(kind: str, group: Any | None = None) -> torch.device:
    """This rank's device of ``kind`` (:func:`device_index`), from ``group``'s binding (else the default group's),
    ``LOCAL_RANK`` and the devices this process sees."""
    import torch.distributed as dist

    bound = getattr(group, "bound_device_id", None) if group is not None else None
    if bound is None and dist.is_initialized():
        bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    count = torch.get_device_module(kind).device_count()
    return torch.device(kind, device_index(kind, bound, os.environ.get("LOCAL_RANK"), count))


def collective_device(group: Any | None = None) -> torch.device:
    """The device the library's tensors take in a collective on ``group`` (None: the default process group): the
    CPU where the group takes CPU tensors, else this rank's device (:func:`rank_device`)."""
    import torch.distributed as dist

    kind = device_type_for(str(dist.get_backend(group)))
    return torch.device("cpu") if kind == "cpu" else rank_device(kind, group)


def mesh_device(mesh: Any) -> torch.device:
    """The device this rank's shards of a DTensor on ``mesh`` go to: the CPU for a CPU mesh, else this rank's
    device (:func:`rank_device`, from the mesh's process group)."""
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    return rank_device(kind, mesh.get_group() if mesh.ndim == 1 else None)
