"""bf16 -> fp16 fallback for devices without bfloat16 (pre-Ampere GPUs such as the V100, some mobile GPUs).

Loading in bf16 for such a device would either fail in the first kernel or run
it emulated; the load instead casts each tensor to fp16 as it is read (the
same two bytes per element, a narrower range), and warns once per device.
Whether a device supports bf16 is decided by :func:`supports_bf16`, which
:func:`assume_bf16_support` can override (for tests, or a device the check gets wrong).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from lightning_lowmem.plan import LoadPlan

_OVERRIDES: dict[str, bool] = {}


class BF16FallbackWarning(UserWarning):
    """bf16 was asked for on a device without it; fp16 is used instead."""


def supports_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` runs bfloat16 natively.

    CPU: yes. CUDA: ``torch.cuda.is_bf16_supported(including_emulation=False)`` on that
    device (compute capability 8.0+, or ROCm). Other devices: whether a bf16 tensor can be
    made there. An :func:`assume_bf16_support` override for the device (or its type) wins.

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


def fallback_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """``torch.float16`` (with a :class:`BF16FallbackWarning` naming ``device``) for bf16 on a device
    without it; ``dtype`` otherwise."""
    if dtype != torch.bfloat16 or supports_bf16(device):
        return dtype
    warnings.warn(
        f"{device} does not support bfloat16: loading in float16 instead, converting each tensor as it is read. "
        "fp16 has a narrower range than bf16; if outputs overflow (inf/nan), load in float32.",
        BF16FallbackWarning, stacklevel=3)
    return torch.float16


def apply_dtype_fallback(plan: LoadPlan) -> dict[str, torch.dtype]:
    """Turn every bf16 target of ``plan`` bound for a device without bf16 into fp16, warning once per device.

    Returns:
        Device -> the dtype bf16 tensors get there, for each device that fell back.
    """
    decided: dict[str, torch.dtype] = {}
    for target in plan.targets:
        if target.dtype != torch.bfloat16:
            continue
        key = str(target.device)
        if key not in decided:
            decided[key] = fallback_dtype(target.dtype, target.device)
        target.dtype = decided[key]
    return {device: dtype for device, dtype in decided.items() if dtype != torch.bfloat16}
