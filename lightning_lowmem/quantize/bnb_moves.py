"""bitsandbytes' weights moving whole (``moves.py``): what their modules' forwards read beside the weight's data.

* ``Params4bit`` (``Linear4bit``): the packed data and every tensor of its ``quant_state`` (scales, code table and,
  with double quantization, the offset and the nested state's scales and code). Rebuilt as a new ``Params4bit``
  around the parts, with a copy of the quant state pointing at them; its module's own ``quant_state`` follows.
* ``Int8Params`` (``Linear8bitLt``): the int8 codes (its data, which is also its ``CB``) and the row scales ``SCB``
  (kept in the module's ``state`` after its first forward). Rebuilt around the parts with ``CB`` and ``SCB`` set, and
  the module's state emptied, so that its next forward takes them from the weight (``init_8bit_state``).

bitsandbytes is not imported: its classes are known by name.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from lightning_lowmem.quantize.moves import Kind, register_kind


def _is_bnb(tensor: object, name: str) -> bool:
    return type(tensor).__name__ == name and type(tensor).__module__.startswith("bitsandbytes")


def _new_param(tensor: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """A Parameter of ``tensor``'s class around ``data``, with ``tensor``'s attributes."""
    built = torch.Tensor._make_subclass(type(tensor), data, tensor.requires_grad)
    built.__dict__.update(tensor.__dict__)
    return built


class Bnb4bitKind(Kind):
    """A bitsandbytes ``Params4bit`` and its quant state."""

    def claims(self, tensor: torch.Tensor) -> bool:
        return _is_bnb(tensor, "Params4bit") and getattr(tensor, "quant_state", None) is not None

    def parts(self, tensor: torch.Tensor, owners: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
        return {"data": tensor.data, **_state_parts(tensor.quant_state, "")}

    def build(self, tensor: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        built = _new_param(tensor, parts["data"])
        built.quant_state = _state_around(tensor.quant_state, parts, "")
        return built

    def attach(self, owner: nn.Module, built: torch.Tensor) -> None:
        if "quant_state" in owner.__dict__:
            owner.quant_state = built.quant_state


def _state_parts(state: object, prefix: str) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for name, value in vars(state).items():
        if isinstance(value, torch.Tensor):
            found[prefix + name] = value
        elif type(value).__name__ == "QuantState":  # the nested state of double quantization
            found |= _state_parts(value, f"{prefix}{name}.")
    return found


def _state_around(state: object, parts: dict[str, torch.Tensor], prefix: str) -> object:
    """A copy of ``state`` whose tensors are ``parts`` (``state`` is left as it is)."""
    built = copy.copy(state)
    for name, value in vars(state).items():
        if isinstance(value, torch.Tensor):
            setattr(built, name, parts[prefix + name])
        elif type(value).__name__ == "QuantState":
            setattr(built, name, _state_around(value, parts, f"{prefix}{name}."))
    return built


class BnbInt8Kind(Kind):
    """A bitsandbytes ``Int8Params`` (quantized: int8 codes) and its row scales."""

    def claims(self, tensor: torch.Tensor) -> bool:
        return _is_bnb(tensor, "Int8Params") and tensor.dtype == torch.int8

    def parts(self, tensor: torch.Tensor, owners: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
        scales = tensor.SCB
        if scales is None:  # after a first forward, the module's state holds them
            scales = next((m.state.SCB for m in owners if getattr(getattr(m, "state", None), "SCB", None) is not None),
                          None)
        if scales is None:
            raise ValueError("An int8 bitsandbytes weight has no row scales (SCB), on the weight or in its module's "
                             "state: it cannot be moved. Quantize it again (load it with quantize='bnb.int8').")
        return {"data": tensor.data, "SCB": scales}

    def build(self, tensor: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        built = _new_param(tensor, parts["data"])
        built.CB, built.SCB = parts["data"], parts["SCB"]
        return built

    def attach(self, owner: nn.Module, built: torch.Tensor) -> None:
        state = getattr(owner, "state", None)
        if state is not None and hasattr(state, "SCB"):
            state.CB = state.SCB = state.idx = None  # its next forward takes them from the weight


register_kind(Bnb4bitKind())
register_kind(BnbInt8Kind())
