"""The library's collectives: their tensors on the device the process group reduces, a lost rank as our error.

Lightning's CUDA strategies create an NCCL-only process group, and a collective on a CPU tensor there raises
``RuntimeError: No backend type associated with device type cpu``; under gloo a CUDA tensor takes a copy each
way. Every collective of the library (the ranks' agreement, ``check_peers``, the shared headers, the NF4 sums)
puts its tensors on :func:`collective_device`, which the runtime's execution module decides
(``runtime/rank_device.py``) from the backend the group reports (``torch.distributed.get_backend``): the CPU where
one of the group's backends takes CPU tensors (``gloo``, a mixed ``"cpu:gloo,cuda:nccl"`` group: the tensors here are
a few bytes made on the CPU), else this rank's device: the one its process group is bound to (Lightning binds it),
else ``LOCAL_RANK``'s (torchrun), never the current device.

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
from lightning_lowmem.runtime.execution import collective_device, device_type_for

__all__ = ["collective", "collective_device", "device_type_for"]


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
