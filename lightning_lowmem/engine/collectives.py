"""The library's collectives: their tensors on the device the process group reduces, a lost rank as our error.

Lightning's CUDA strategies create an NCCL-only process group, and a collective on a CPU tensor there raises
``RuntimeError: No backend type associated with device type cpu``; under gloo a CUDA tensor takes a copy each
way. Every collective of the library (the ranks' agreement, ``check_peers``, the shared headers, the NF4 sums)
puts its tensors on :func:`collective_device`, chosen from the backend the group reports
(``torch.distributed.get_backend``): the CPU where one of the group's backends takes CPU tensors (``gloo``, a
mixed ``"cpu:gloo,cuda:nccl"`` group: the tensors here are a few bytes made on the CPU), else the group's device
(``nccl``: this process's current CUDA device, which Lightning sets to the rank's own).

A rank whose process ended inside a collective (killed for memory, its node lost) leaves the others with the
backend's own error (gloo: ``RuntimeError: ... Connection closed by peer``; NCCL: a ``DistBackendError``).
:func:`collective` turns it into :class:`RankLostError`, a ``LowMemError`` that says which collective, on which
rank, and what to do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from lightning_lowmem.errors import RankLostError


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


def collective_device(group: object | None = None) -> torch.device:
    """The device the library's tensors take in a collective on ``group`` (None: the default process group): the
    CPU, or this process's current device of the group's kind (``torch.cuda.current_device()`` under NCCL)."""
    import torch.distributed as dist

    kind = device_type_for(str(dist.get_backend(group)))
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Run one collective; the backend's error when it fails (a peer gone) raised as :class:`RankLostError`.

    Args:
        what: what the ranks were doing, for the message ("agreeing whether any rank failed while reading its
            shard").
    """
    try:
        yield
    except RankLostError:
        raise
    except RuntimeError as e:  # gloo raises RuntimeError, NCCL DistBackendError (a RuntimeError)
        raise _lost(what, e) from e


def _lost(what: str, error: RuntimeError) -> RankLostError:
    import torch.distributed as dist

    where = f"rank {dist.get_rank()} of {dist.get_world_size()}" if dist.is_initialized() else "this rank"
    message = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    return RankLostError(
        f"A collective between the ranks failed on {where} while {what}: {message}. Another rank's process most "
        "likely ended (killed for memory, its node lost) or the connection to it broke; nothing was loaded here. "
        "Look at the other ranks' logs for the cause, then start every rank again.")
