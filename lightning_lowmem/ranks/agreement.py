"""Many ranks loading one checkpoint: which rank this is, and every rank failing together, at any stage.

Each rank plans its load from the same headers, so a checkpoint that does not fit the model fails on every
rank alike. A failure on some ranks only (a file missing on one node, a read error on one disk, a file
changed under one rank, a damaged tensor one rank reads) must still stop all of them: a rank that went on
would wait forever in the model's first collective. Each stage of a sharded load runs inside
:func:`agreement`; when the stage ends, on every rank, the ranks exchange whether it succeeded:

* one small all-reduce (did any rank fail? :func:`_exchange_box`), then
* when one did, or when the stage shares something (a rank's CRC-32s of what it read), one
  ``all_gather_object`` of each rank's outcome and share.

Then every rank raises the same error: the same type (a ``LowMemError`` subclass, or ``ValueError``,
``TypeError`` or ``KeyError`` for bad arguments; ``LowMemError`` for anything else) and the same message, naming the first failing rank and
its own message; the failing rank's error is chained to its own exception. No timeout is involved: a rank
that fails goes straight to the exchange, which the others reach when their stage ends.

A collective *inside* a stage must be preceded by :func:`check_peers`: the same all-reduce, so that a rank that
failed before that collective meets the others there instead of leaving them in it. A sum inside a stage (the NF4
block scales of a weight, summed over the ranks holding its rows) is that all-reduce itself
(:func:`checked_sum`): the failure flag and each group's sum travel in one tensor, so a weight costs one
collective, not a check and then a sum. After an agreed error, enclosing stages raise it as it is, with no
exchange of their own (every rank raised it at the same point).

Every collective here runs on the device the process group reduces (``collectives.py``: the CPU under gloo,
this rank's CUDA device under NCCL). A rank whose process ended inside one (killed for memory) leaves the
others a :class:`~lightning_lowmem.errors.RankLostError`, raised as it is by every enclosing stage: there is
no one left to exchange with.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from lightning_lowmem import errors
from lightning_lowmem.ranks.collectives import collective, collective_device
from lightning_lowmem.errors import LowMemError, RankLostError

_ARGUMENT_ERRORS = ("ValueError", "TypeError", "KeyError")
"""Built-in errors (bad arguments: Lightning's strict key check raises ``KeyError``) raised as they are on every
rank; any other error not ours becomes a ``LowMemError``."""
_AGREED = "_lowmem_agreed"
"""Set on an error every rank raised at the same point (an enclosing stage raises it as it is)."""


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    if not _distributed():
        return 0
    import torch.distributed as dist

    return dist.get_rank()


class _Outcome(NamedTuple):
    """What a failed rank tells the others: its rank, its error's type name and message, its stage."""

    rank: int
    kind: str
    message: str
    stage: str


class PeerFailedError(LowMemError):
    """Raised by :func:`check_peers` inside a stage when another rank failed: the stage's :func:`agreement`
    replaces it with the failing rank's error."""


class Agreement:
    """One stage every rank runs: what this rank shares with the others (``share``), and, after the stage,
    what each rank shared (``shared``, by rank; ``[share]`` without a process group).

    Args:
        stage: what the ranks were doing, for messages ("while reading its shard").
        active: whether the ranks take part.
        share: whether the ranks gather their shares when the stage ends.
    """

    def __init__(self, stage: str, active: bool, share: bool = False) -> None:
        self.stage, self.active, self.shares = stage, active, share
        self.share: Any = None
        self.shared: list[Any] = []
        self._heard = False  # check_peers already heard of a failure: the status exchange is done

    def any_failed(self, failed: bool) -> bool:
        """One all-reduce (:func:`_exchange_box`): whether any rank (this one if ``failed``) failed."""
        import torch.distributed as dist

        box = _exchange_box()
        box[0] = float(failed)
        with collective(f"agreeing whether any rank failed {self.stage}"):
            dist.all_reduce(box, op=dist.ReduceOp.SUM)
        return bool(box[0].item())

    def stop_if(self, failed: bool) -> None:
        """Raise :class:`PeerFailedError` when an in-stage check heard that another rank ``failed``: the status
        exchange is then done, and the stage's end exchanges the ranks' errors."""
        if failed:
            self._heard = True
            raise PeerFailedError("Another rank failed; its error is raised once the ranks have exchanged it.")


def _exchange_box() -> Any:
    """The one tensor every in-stage all-reduce and every stage's failure check reduce (a ``SUM`` over the default
    group): float64, ``world size + 1`` long; slot 0 counts the ranks that failed, slot ``1 + r`` holds the sum of
    the group whose lowest rank is ``r`` (:func:`checked_sum`). Every such collective has this one shape, so a rank
    that failed and went to its stage's end meets the others in whichever of them they are in."""
    import torch
    import torch.distributed as dist

    return torch.zeros(dist.get_world_size() + 1, dtype=torch.float64, device=collective_device())


_stages: list[Agreement] = []  # the stages this process is in, innermost last


def _active_stage() -> Agreement | None:
    """The innermost stage this process is in, where the ranks take part in it."""
    stage = _stages[-1] if _stages else None
    return stage if stage is not None and stage.active else None


def check_peers() -> None:
    """Call immediately before a collective inside a stage of :func:`agreement` (an all-reduce while streaming).

    Raises:
        PeerFailedError: another rank failed before reaching this point; the stage's agreement then raises
            that rank's error on every rank. Without an active stage, nothing is exchanged.
    """
    stage = _active_stage()
    if stage is not None:
        stage.stop_if(stage.any_failed(False))


def checked_sum(value: Any, group: Any, what: str) -> Any:
    """``value`` (a scalar tensor) summed in float64 over the ranks of ``group``, in the one all-reduce that is also
    :func:`check_peers` (:func:`_exchange_box`): every rank of the default group calls it at the same point.

    Args:
        value: this rank's part (on any device; the sum comes back on it, with no wait on the host for it).
        group: the process group whose ranks' values are summed (a mesh dimension's).
        what: what the sum is, for the message when a rank is lost in it.

    Raises:
        PeerFailedError: another rank failed before this point (inside a stage of :func:`agreement`).
    """
    import torch
    import torch.distributed as dist

    box = _exchange_box()
    slot = 1 + min(dist.get_process_group_ranks(group))  # the group's slot: its lowest rank's
    box[slot] = value.reshape(()).to(box.device, torch.float64)
    with collective(what):
        dist.all_reduce(box, op=dist.ReduceOp.SUM)
    stage = _active_stage()
    if stage is not None:
        stage.stop_if(bool(box[0].item()))
    return box[slot].to(value.device)


def from_first_rank(make: Callable[[], Any], send: Callable[[Any], Any] = lambda value: value) -> Any:
    """``make()`` on rank 0; the other ranks get ``send(its result)`` from it (one ``broadcast_object_list``), inside
    a stage of :func:`agreement` (outside one, or without a process group: ``make()`` here).

    Rank 0 makes first, then every rank calls :func:`check_peers`, then rank 0 broadcasts: a rank 0 that fails
    while making meets the others in their check instead of leaving them in the broadcast.
    """
    stage = _active_stage()
    if stage is None:
        return make()
    import torch.distributed as dist

    value = make() if rank() == 0 else None
    check_peers()
    box = [send(value) if rank() == 0 else None]
    with collective(f"sending what rank 0 made to the others {stage.stage}"):
        dist.broadcast_object_list(box, src=0, device=collective_device())
    return value if rank() == 0 else box[0]


@contextlib.contextmanager
def agreement(active: bool, stage: str = "before reading its shard", share: bool = False) -> Iterator[Agreement]:
    """Run the block on every rank, then raise on every rank if it raised on any.

    Args:
        active: whether the ranks take part (a sharded module in a process group); False runs the
            block as it is.
        stage: what the ranks were doing, for messages.
        share: gather what each rank put in ``Agreement.share`` into ``Agreement.shared`` (every rank
            must pass the same value).

    Raises:
        on every rank, an error of the first failing rank's type (a ``LowMemError`` subclass,
        or a built-in error for bad arguments; ``LowMemError`` otherwise) naming that rank and its message.
    """
    agreed = Agreement(stage, active and _distributed(), share)
    if not agreed.active:
        yield agreed
        agreed.shared = [agreed.share]
        return
    error: Exception | None = None
    _stages.append(agreed)
    try:
        yield agreed
    except Exception as e:  # noqa: BLE001  (every rank must hear of it before it is raised)
        error = e
    finally:
        _stages.pop()
    if error is not None and (getattr(error, _AGREED, False) or isinstance(error, RankLostError)):
        raise error  # every rank raised it at the same point, or a rank is gone: nothing more to exchange
    try:
        _exchange(agreed, error)
    except RankLostError as lost:
        if error is not None and not isinstance(error, PeerFailedError):
            lost.add_note(f"This rank had failed {agreed.stage} too: {type(error).__name__}: {error}")
        raise


def _exchange(agreed: Agreement, error: Exception | None) -> None:
    """The stage's end on this rank: whether any rank failed, then (when one did, or to share) each rank's outcome."""
    import torch.distributed as dist

    failed = agreed._heard or agreed.any_failed(error is not None)
    if not (failed or agreed.shares):
        return
    own = None if error is None or isinstance(error, PeerFailedError) else _Outcome(
        rank(), type(error).__name__, str(error), agreed.stage)
    gathered: list[tuple[_Outcome | None, Any] | None] = [None] * dist.get_world_size()
    with collective(f"exchanging each rank's outcome {agreed.stage}"):
        dist.all_gather_object(gathered, (own, agreed.share))
    agreed.shared = [share for _, share in gathered]
    outcomes = [outcome for outcome, _ in gathered if outcome is not None]
    if outcomes:
        raise _agreed_error(outcomes, len(gathered)) from error


def _agreed_error(outcomes: list[_Outcome], world: int) -> Exception:
    """The error every rank raises: the first failing rank's type, naming it, its stage and its message."""
    first = outcomes[0]
    when = "so no rank read anything" if first.stage == "before reading its shard" else "so every rank stopped"
    more = f" ({len(outcomes)} ranks failed)" if len(outcomes) > 1 else ""
    error = _error(first.kind, f"Rank {first.rank} of {world} failed {first.stage}, {when}{more}: {first.message}")
    setattr(error, _AGREED, True)
    return error


def _error(kind: str, message: str) -> Exception:
    """An exception of the class named ``kind`` (one of ours, or a built-in error for bad arguments)."""
    cls = getattr(errors, kind, None) or (getattr(builtins, kind, None) if kind in _ARGUMENT_ERRORS else None)
    if isinstance(cls, type) and issubclass(cls, Exception) and cls is not PeerFailedError:
        try:
            return cls(message)
        except TypeError:  # an error with required keywords (MemoryBudgetError)
            pass
    return LowMemError(message)
