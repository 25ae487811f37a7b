"""Third-party messages a user can do nothing about, silenced while this library imports and runs those libraries.

Importing torchao on a CPU build logs ``Failed to load .../_C_mxfp8...so`` for each CUDA kernel library it ships,
and its enums make torch log ``register_constant() on Enum subclasses is deprecated`` (``torch.utils._pytree``);
transformers imports torchao when it is installed. Importing bitsandbytes on a CPU with AVX-512 BF16 logs that the
optional ``kernels`` package is missing. None of it changes what a load does.

The filter is scoped twice: to those loggers and those messages only (every other record of theirs passes), and
to the time this library is at work (:func:`quiet` as a context manager, :func:`quietly` as a decorator). Nothing
is set globally: no ``warnings.filterwarnings``, no logger level changed, the filters removed on the way out.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

NOISE: dict[str, tuple[str, ...]] = {
    # torchao's CUDA and mxfp8 kernel libraries, which a CPU build of torch cannot load
    "torchao": ("Failed to load ",),
    "torchao.kernel.intmm": ("Warning: Detected no triton",),
    # torchao registers its Enums as pytree constants; torch 2.13 logs a deprecation for each
    "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported",),
    # bitsandbytes' optional CPU kernel from the `kernels` package; its own kernel is used without it
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),
}
"""Logger name -> the start of each message (the record's unformatted ``msg``) dropped from it."""

P = ParamSpec("P")
R = TypeVar("R")


class _Drop(logging.Filter):
    """Drops a logger's records whose message starts with one of ``starts``."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


_FILTERS = {name: _Drop(starts) for name, starts in NOISE.items()}
_LOCK = threading.Lock()
_DEPTH = 0  # nested quiet() blocks (a face calling another): the filters leave with the outermost


@contextmanager
def quiet() -> Iterator[None]:
    """Drop :data:`NOISE` from its loggers inside the block; every other message passes.

    Example::

        >>> import logging
        >>> with quiet():
        ...     logging.getLogger("torchao").warning("Failed to load _C_mxfp8.so")  # dropped
        >>> logging.getLogger("torchao").filters
        []
    """
    global _DEPTH
    with _LOCK:
        if _DEPTH == 0:
            for name, drop in _FILTERS.items():
                logging.getLogger(name).addFilter(drop)
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                for name, drop in _FILTERS.items():
                    logging.getLogger(name).removeFilter(drop)


def quietly(function: Callable[P, R]) -> Callable[P, R]:
    """``function`` run inside :func:`quiet`."""
    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with quiet():
            return function(*args, **kwargs)

    return wrapper
