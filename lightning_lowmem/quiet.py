"""Third-party messages a user can do nothing about, silenced while this library imports and runs those libraries.

Importing torchao on a CPU build logs ``Failed to load .../_C_mxfp8...so`` for each CUDA kernel library it ships,
and its enums make torch log ``register_constant() on Enum subclasses is deprecated`` (``torch.utils._pytree``);
transformers imports torchao when it is installed. Importing bitsandbytes on a CPU with AVX-512 BF16 logs that the
optional ``kernels`` package is missing. None of it changes what a load does. bitsandbytes' int8 matmul says that
it casts bf16 inputs to fp16 on every call (2,400 lines for 50 tokens of pythia-160m): that is told once.

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
ONCE: dict[str, tuple[str, ...]] = {
    # bitsandbytes' int8 matmul casts bf16 inputs to fp16 and says so on every call: once per layer per token
    "bitsandbytes.autograd._functions": ("MatMul8bitLt: inputs will be cast",),
}
"""Logger name -> the start of each message told once per :func:`quiet` block (the outermost), its repeats dropped."""

P = ParamSpec("P")
R = TypeVar("R")


class _Drop(logging.Filter):
    """Drops a logger's records whose message starts with one of ``starts``."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


class _Once(logging.Filter):
    """Passes the first of a logger's records whose message starts with one of ``starts``, drops its repeats (every
    other record passes); :meth:`reset` forgets what was seen."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.starts):
            return True
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True

    def reset(self) -> None:
        self.seen.clear()


_FILTERS: dict[str, list[logging.Filter]] = {}
for _name, _starts in NOISE.items():
    _FILTERS.setdefault(_name, []).append(_Drop(_starts))
for _name, _starts in ONCE.items():
    _FILTERS.setdefault(_name, []).append(_Once(_starts))
_LOCK = threading.Lock()
_DEPTH = 0  # nested quiet() blocks (a face calling another): the filters leave with the outermost


@contextmanager
def quiet() -> Iterator[None]:
    """Drop :data:`NOISE` from its loggers inside the block, and tell each of :data:`ONCE` once; every other message
    passes.

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
            for name, filters in _FILTERS.items():
                for one in filters:
                    logging.getLogger(name).addFilter(one)
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                for name, filters in _FILTERS.items():
                    for one in filters:
                        logging.getLogger(name).removeFilter(one)
                        if isinstance(one, _Once):
                            one.reset()


def quietly(function: Callable[P, R]) -> Callable[P, R]:
    """``function`` run inside :func:`quiet`."""
    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with quiet():
            return function(*args, **kwargs)

    return wrapper
