"""Quantization schemes: small frozen configs tied to their transform by a registry.

A scheme is a frozen dataclass, validated in ``__post_init__``, that knows

* whether its kernels exist on a device (:meth:`QuantScheme.unavailable_reason`),
* whether it can take a given ``nn.Linear`` (:meth:`QuantScheme.layer_reason`),
* which module stands in for that Linear on the meta device (:meth:`QuantScheme.replace`),
* how to quantize a full-precision weight into that module (:meth:`QuantScheme.load_weight`).

:func:`register_scheme` files a class under its spelling in :data:`SCHEMES`; adding
a scheme is adding a class (see ``bnb.py`` and ``torchao.py`` next to this file).

Example::

    >>> from lightning_lowmem.quantize import SCHEMES
    >>> sorted(SCHEMES)[:2]
    ['bnb.fp4', 'bnb.fp4-dq']
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch
from torch import nn

from lightning_lowmem.errors import UnsupportedQuantizationError
from lightning_lowmem.quantize.chunks import RowSource

SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class QuantScheme:
    """Base class of every scheme. Subclasses are frozen dataclasses holding the scheme's options."""

    name: ClassVar[str] = ""
    """The spelling the scheme is registered under, e.g. ``"bnb.nf4"`` (set by :func:`register_scheme`)."""
    package: ClassVar[str] = ""
    """The pip package whose kernels the scheme uses."""
    by_rows: ClassVar[bool] = False
    """Whether :meth:`load_weight` also takes a :class:`~lightning_lowmem.quantize.chunks.RowSource`: the loader
    then reads the weight a block of rows at a time, and the whole full-precision weight never exists."""

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why the scheme cannot run on ``device`` (a missing package or kernel), or None when it can."""
        if importlib.util.find_spec(self.package) is None:
            return f"it needs the package {self.package!r}, which is not installed (pip install {self.package})"
        if device.type not in SUPPORTED_DEVICE_TYPES:
            return f"lightning_lowmem runs it only on {' and '.join(SUPPORTED_DEVICE_TYPES)}"
        if device.type == "cuda" and not torch.cuda.is_available():
            return "CUDA is not available in this PyTorch build or on this machine"
        return None

    def layer_reason(self, linear: nn.Linear, dtype: torch.dtype) -> str | None:
        """Why ``linear`` (whose weight will arrive in ``dtype``) cannot be quantized, or None when it can."""
        if not dtype.is_floating_point:
            return f"its weight is {dtype}, not floating point"
        return None

    def replace(self, linear: nn.Linear, dtype: torch.dtype) -> nn.Module:
        """The module that takes ``linear``'s place before its weight is read (weights on meta)."""
        return linear

    def load_weight(self, module: nn.Module, weight: torch.Tensor | RowSource) -> None:
        """Quantize the full-precision ``weight`` into ``module`` (made by :meth:`replace`).

        ``weight`` is a :class:`RowSource` only for schemes with :attr:`by_rows`. Must keep no
        reference to ``weight``: the loader frees it before reading the next tensor.
        """
        raise NotImplementedError


SchemeT = TypeVar("SchemeT", bound=type[QuantScheme])

SCHEMES: dict[str, type[QuantScheme]] = {}
"""Spelling -> scheme class. Filled by :func:`register_scheme`."""


def register_scheme(name: str) -> Callable[[SchemeT], SchemeT]:
    """Class decorator: file a scheme under ``name`` (its ``quantize=`` spelling).

    Example::

        >>> @register_scheme("mylib.int8")  # doctest: +SKIP
        ... @dataclass(frozen=True)
        ... class MyInt8(QuantScheme):
        ...     package: ClassVar[str] = "mylib"
    """

    def decorate(cls: SchemeT) -> SchemeT:
        if name in SCHEMES and SCHEMES[name] is not cls:
            raise ValueError(f"Quantization scheme {name!r} is already registered by {SCHEMES[name].__qualname__}.")
        cls.name = name
        SCHEMES[name] = cls
        return cls

    return decorate


def make_scheme(name: str) -> QuantScheme:
    """The scheme registered as ``name``, with its default options.

    Raises:
        UnsupportedQuantizationError: no scheme has that name.
    """
    cls = SCHEMES.get(name)
    if cls is None:
        raise UnsupportedQuantizationError(
            f"Unknown quantization scheme {name!r}. Known schemes: {', '.join(repr(n) for n in SCHEMES)}. "
            "Pass one of these as quantize=, or None to load in full precision."
        )
    return cls()


def schemes_available_on(device: torch.device) -> list[str]:
    """The names of the registered schemes whose kernels run on ``device``."""
    return [name for name, cls in SCHEMES.items() if cls().unavailable_reason(device) is None]


def check_available(scheme: QuantScheme, device: torch.device) -> None:
    """Raise :class:`UnsupportedQuantizationError` when ``scheme`` has no kernel on ``device``.

    The message names the scheme, the device, the reason (usually a missing package) and the
    schemes that do work there.
    """
    reason = scheme.unavailable_reason(device)
    if reason is None:
        return
    working = schemes_available_on(device)
    others = ", ".join(repr(n) for n in working) if working else "none"
    raise UnsupportedQuantizationError(
        f"Quantization scheme {scheme.name!r} cannot run on device {str(device)!r}: {reason}. "
        f"Schemes that work on {str(device)!r} here: {others}. "
        "Pick one of those, or fix what is missing; nothing was read from the checkpoint."
    )
