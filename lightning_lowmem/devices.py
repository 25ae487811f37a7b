"""The devices a load may target: checked before any file is opened."""

from __future__ import annotations

import torch

from lightning_lowmem.errors import DeviceUnavailableError


def check_device_available(device: torch.device | None) -> None:
    """Raise :class:`DeviceUnavailableError` if ``device`` cannot hold tensors here.

    CPU and meta always can. A CUDA device needs a CUDA build of PyTorch, a visible GPU and,
    for ``cuda:N``, at least ``N + 1`` of them.
    """
    if device is None or device.type in ("cpu", "meta"):
        return
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"PyTorch {torch.__version__}" + ("" if torch.version.cuda else ", a build without CUDA")
            raise DeviceUnavailableError(
                f"device={str(device)!r} was asked for, but CUDA is not available ({build}; "
                "no GPU visible). Load with device='cpu' (quantized schemes bnb.* and torchao.int8* run there), "
                "or install a CUDA build of torch on a machine with a GPU.")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceUnavailableError(
                f"device={str(device)!r} was asked for, but this machine has {torch.cuda.device_count()} "
                f"CUDA device(s) (cuda:0 to cuda:{torch.cuda.device_count() - 1}).")
        return
    module = getattr(torch, device.type, None)
    available = getattr(module, "is_available", None)
    if callable(available) and not available():
        raise DeviceUnavailableError(f"device={str(device)!r} was asked for, but {device.type} is not available "
                                     "on this machine. Load with device='cpu'.")


def cuda_or_none(device: torch.device | str | None) -> torch.device | None:
    """``device`` when it is a CUDA device this machine has, else None (what a memory monitor should watch).

    Example::

        >>> cuda_or_none("cpu") is None
        True
    """
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        return device
    return None


def as_device(device: torch.device | str | int) -> torch.device:
    """``device`` as a ``torch.device``.

    Raises:
        ValueError: torch reads no device from it (``"gpu"``, ``1.5``).

    Example::

        >>> as_device("cuda:1"), as_device("cpu")
        (device(type='cuda', index=1), device(type='cpu'))
    """
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be a torch.device or a device string such as 'cpu', 'cuda' or 'cuda:1', got "
                         f"{device!r}.") from e


def indexed(device: torch.device | str) -> torch.device:
    """``device`` with its index: a bare ``"cuda"`` is the current CUDA device (``cuda:0`` unless set), since
    Lightning's CUDA accelerator passes the device to ``torch.cuda.set_device``, which refuses one without an index.
    Anything else is returned as a ``torch.device``, unchanged.

    Raises:
        ValueError: torch reads no device from it (:func:`as_device`).
    """
    device = as_device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device
