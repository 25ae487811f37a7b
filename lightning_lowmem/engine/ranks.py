"""Many ranks loading one checkpoint: which rank this is, and every rank failing together before any read.

Each rank plans its load from the same headers, so a checkpoint that does not fit the model
fails on every rank alike. A failure on some ranks only (a file missing on one node, a rank
built with another config) must still stop all of them: a rank that went on would wait forever
in the model's first collective. :func:`agreement` has the ranks exchange, before any weight is
read, whether their plan succeeded (one ``all_gather_object`` on the default process group);
then every rank raises, its own error or the first failing rank's, of the same type.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Iterator

from lightning_lowmem import errors
from lightning_lowmem.errors import LowMemError


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    if not _distributed():
        return 0
    import torch.distributed as dist

    return dist.get_rank()


@contextlib.contextmanager
def agreement(active: bool) -> Iterator[None]:
    """Run the block on every rank, then raise on every rank if it raised on any.

    Args:
        active: whether the ranks take part (a sharded module in a process group); False runs the
            block as it is.

    Raises:
        the block's own exception on the ranks where it raised; on the others, one of the same type
        (a ``LowMemError`` subclass, ``ValueError`` or ``TypeError``; ``LowMemError`` otherwise)
        naming the first failing rank and its message.
    """
    if not (active and _distributed()):
        yield
        return
    import torch.distributed as dist

    error: Exception | None = None
    try:
        yield
    except Exception as e:  # noqa: BLE001  (every rank must hear of it before it is raised)
        error = e
    outcomes: list[tuple[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, None if error is None else (type(error).__name__, str(error)))
    if error is not None:
        raise error
    failed = [(r, outcome) for r, outcome in enumerate(outcomes) if outcome is not None]
    if failed:
        first, (kind, message) = failed[0]
        raise _error(kind, f"Rank {first} of {len(outcomes)} failed before reading its shard, so no rank read "
                           f"anything ({len(failed)} ranks failed): {message}")


def _error(kind: str, message: str) -> Exception:
    """An exception of the class named ``kind`` (one of ours, or ``ValueError``/``TypeError``)."""
    cls = getattr(errors, kind, None) or (getattr(builtins, kind, None) if kind in ("ValueError", "TypeError")
                                           else None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except TypeError:  # an error with required keywords (MemoryBudgetError)
            pass
    return LowMemError(message)
