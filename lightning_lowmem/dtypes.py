"""Dtypes: Lightning's precision flags, a model's own dtype, and bf16 -> fp16 where a device lacks bf16.

* :data:`PRECISION_DTYPES` is the one table between Lightning/litgpt precision flags
  (``"bf16-true"``, ...) and dtypes; :func:`precision_dtype` and :func:`precision_flag` read it.
* :func:`load_dtype` is the one precedence between an explicit ``dtype``, a precision flag and a face's default.
* :func:`model_dtype` is the one answer to "what dtype does this model compute in".
* bf16 -> fp16: loading in bf16 for a device without it (pre-Ampere GPUs such as the V100,
  some mobile GPUs) would either fail in the first kernel or run it emulated; the load
  instead casts each tensor to fp16 as it is read (the same two bytes per element, a
  narrower range), and warns once per device. Whether a device supports bf16 is decided
  by :func:`supports_bf16`, which :func:`assume_bf16_support` can override (for tests, or
  a device the check gets wrong).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn

PRECISION_DTYPES: dict[str, torch.dtype] = {
    "bf16-true": torch.bfloat16, "bf16": torch.bfloat16, "16-true": torch.float16, "16": torch.float16,
    "32-true": torch.float32, "32": torch.float32, "64-true": torch.float64, "64": torch.float64,
}
"""Precision flags that keep weights in one dtype (Fabric's, the Trainer's and litgpt's spellings) -> that dtype.
Mixed precisions (``"bf16-mixed"``) keep fp32 weights, which is what a low-memory load avoids."""


def precision_dtype(precision: str) -> torch.dtype:
    """The dtype of a ``"-true"`` precision flag.

    Raises:
        TypeError: not a str.
        ValueError: a flag that is not in :data:`PRECISION_DTYPES` (mixed precisions included).

    Example::

        >>> precision_dtype("bf16-true")
        torch.bfloat16
    """
    if not isinstance(precision, str):
        raise TypeError(f"precision must be a str such as 'bf16-true', got {precision!r}.")
    if precision not in PRECISION_DTYPES:
        raise ValueError(
            f"precision={precision!r} is not a precision that keeps weights in one dtype; use one of "
            f"{', '.join(sorted(PRECISION_DTYPES))}. Mixed precisions keep fp32 weights, which is what a "
            "low-memory load avoids."
        )
    return PRECISION_DTYPES[precision]


def precision_flag(dtype: torch.dtype) -> str:
    """The ``"-true"`` flag (Lightning's spelling) of ``dtype``.

    Example::

        >>> precision_flag(torch.float16)
        '16-true'
    """
    flags = {d: flag for flag, d in PRECISION_DTYPES.items() if flag.endswith("-true")}
    if dtype not in flags:
        raise ValueError(f"{dtype} has no Lightning precision flag; use one of {', '.join(map(str, flags))}.")
    return flags[dtype]


def load_dtype(dtype: torch.dtype | None = None, precision: str | torch.dtype | None = None,
               default: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype a load casts floating tensors to, the one precedence every face uses: ``dtype`` (the load option),
    else ``precision`` (a precision flag such as ``"bf16-true"``, or the dtype a precision plugin converts to),
    else ``default`` (a face's own: bf16 for generation; None keeps each tensor's dtype).

    Raises:
        ValueError: ``dtype`` and ``precision`` are both given and disagree.

    Example::

        >>> load_dtype(None, "16-true", torch.bfloat16), load_dtype(None, None, torch.bfloat16)
        (torch.float16, torch.bfloat16)
        >>> load_dtype(torch.float32, "32-true")
        torch.float32
    """
    from_precision = precision_dtype(precision) if isinstance(precision, str) else precision
    if dtype is not None and from_precision is not None and dtype != from_precision:
        raise ValueError(f"dtype={dtype} and precision={precision!r} ({from_precision}) disagree: pass one of them.")
    return dtype or from_precision or default


def model_dtype(module: nn.Module, dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype ``module`` computes in: ``dtype`` when given (the dtype it is loaded in), else its input
    embedding's, else its most common floating dtype, else the compute dtype of a quantized layer in it
    (bitsandbytes' ``compute_dtype``), else torch's default.

    Example::

        >>> model_dtype(torch.nn.Linear(2, 2).to(torch.bfloat16))
        torch.bfloat16
    """
    if dtype is not None:
        return dtype
    embedding = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is not None and embedding.weight.is_floating_point():
        return embedding.weight.dtype
    counts: dict[torch.dtype, int] = {}
    for p in module.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    if counts:
        return max(counts, key=counts.__getitem__)
    computes = (getattr(m, "compute_dtype", None) for m in module.modules())
    return next((d for d in computes if isinstance(d, torch.dtype)), torch.get_default_dtype())


_OVERRIDES: dict[str, bool] = {}


class BF16FallbackWarning(UserWarning):
    """bf16 was asked for on a device without it; fp16 is used instead."""


def supports_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` runs bfloat16 natively.

    CPU: yes. CUDA: ``torch.cuda.is_bf16_supported(including_emulation=False)`` on that
    device (compute capability 8.0+, or ROCm); a CUDA device this machine does not have (a
    placement planned here for another machine): yes, the load decides on that machine. Other
    devices: whether a bf16 tensor can be made there. An :func:`assume_bf16_support` override
    for the device (or its type) wins.

    Example::

        >>> supports_bf16("cpu")
        True
    """
    device = torch.device(device)
    for key in (str(device), device.type):
        if key in _OVERRIDES:
            return _OVERRIDES[key]
    if device.type == "cpu" or device.type == "meta":
        return True
    if device.type == "cuda":
        if not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count():
            return True
        with torch.cuda.device(device):
            return torch.cuda.is_bf16_supported(including_emulation=False)
    try:
        torch.zeros(1, dtype=torch.bfloat16, device=device)
    except (RuntimeError, TypeError):
        return False
    return True


@contextlib.contextmanager
def assume_bf16_support(device: torch.device | str, supported: bool) -> Iterator[None]:
    """Decide bf16 support for ``device`` (``'cuda:1'``, or a type like ``'cpu'``) inside the block.

    Example::

        >>> with assume_bf16_support("cpu", False):
        ...     supports_bf16("cpu")
        False
    """
    key = str(device)
    before = _OVERRIDES.get(key)
    _OVERRIDES[key] = supported
    try:
        yield
    finally:
        if before is None:
            _OVERRIDES.pop(key, None)
        else:
            _OVERRIDES[key] = before


def fallback_dtype(dtype: torch.dtype, device: torch.device | str, *, warn: bool = True) -> torch.dtype:
    """``torch.float16`` (with a :class:`BF16FallbackWarning` naming ``device``, unless ``warn`` is False) for bf16
    on a device without it; ``dtype`` otherwise. ``device`` is where the tensor computes (an offloaded layer's is
    the execution device, not the CPU that stores it: ``runtime/execution.py``)."""
    if dtype != torch.bfloat16 or supports_bf16(device):
        return dtype
    if not warn:
        return torch.float16
    warnings.warn(
        f"{device} does not support bfloat16: loading in float16 instead, converting each tensor as it is read. "
        "fp16 has a narrower range than bf16; if outputs overflow (inf/nan), load in float32.",
        BF16FallbackWarning, stacklevel=3)
    return torch.float16
