"""How many bytes a (possibly quantized) tensor or module really holds.

``t.untyped_storage().nbytes()`` is wrong for quantized weights: a torchao
tensor subclass reports the storage of its *outer* dtype (an int8 weight shown
as bf16 counts twice its bytes), and a bitsandbytes ``Params4bit`` keeps its
scales in ``quant_state``, outside the parameter's storage. These helpers count
the inner tensors instead, each storage once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def tensor_nbytes(tensor: torch.Tensor | None, seen: set[tuple[str, int]] | None = None) -> int:
    """Bytes held by ``tensor``: its storage, or the inner tensors of a quantized one.

    Args:
        tensor: a plain tensor, a torchao tensor subclass, or a bitsandbytes ``Params4bit`` /
            ``Int8Params``. Meta tensors and None count 0.
        seen: storages already counted (shared or tied storage is counted once); pass the same
            set across calls to count a whole module.

    Example::

        >>> tensor_nbytes(torch.zeros(4, 4, dtype=torch.bfloat16))
        32
    """
    seen = set() if seen is None else seen
    return sum(_storage_nbytes(t, seen) for t in _inner_tensors(tensor))


def module_nbytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``module`` (and quantization state), each storage once."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for mod in module.modules():
        for tensor in [*mod._parameters.values(), *mod._buffers.values()]:
            total += tensor_nbytes(tensor, seen)
        # bitsandbytes' parametrization of a quantized expert stack keeps the scales in its quant_state
        quant_state = getattr(mod, "quant_state", None)
        if quant_state is not None and hasattr(quant_state, "absmax"):
            total += sum(_storage_nbytes(t, seen) for t in _state_tensors(quant_state))
        # bitsandbytes' Linear8bitLt moves its int8 weight and row scales into module.state on its first forward
        state = getattr(mod, "state", None)
        for name in ("CB", "SCB"):
            value = getattr(state, name, None)
            if isinstance(value, torch.Tensor):
                total += tensor_nbytes(value, seen)
    return total


def _inner_tensors(tensor: object) -> Iterator[torch.Tensor]:
    """The plain tensors that hold ``tensor``'s data, depth first."""
    if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
        return
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None:  # a traceable tensor subclass (torchao): its data is in the inner tensors
        names, _ = flatten()
        for name in names:
            yield from _inner_tensors(getattr(tensor, name))
        return
    yield tensor
    quant_state = getattr(tensor, "quant_state", None)  # bitsandbytes Params4bit: scales and code table
    if quant_state is not None:
        yield from _state_tensors(quant_state)
    scales = getattr(tensor, "SCB", None)  # bitsandbytes Int8Params: row scales
    if isinstance(scales, torch.Tensor):
        yield scales


def _state_tensors(state: object) -> Iterator[torch.Tensor]:
    for value in vars(state).values():
        if isinstance(value, torch.Tensor):
            yield from _inner_tensors(value)
        elif value is not None and hasattr(value, "absmax"):  # nested QuantState (double quantization)
            yield from _state_tensors(value)


def _storage_nbytes(tensor: torch.Tensor, seen: set[tuple[str, int]]) -> int:
    if tensor.is_meta or tensor.numel() == 0:
        return 0
    storage = tensor.untyped_storage()
    key = (str(tensor.device), storage.data_ptr())
    if key in seen:
        return 0
    seen.add(key)
    return storage.nbytes()
