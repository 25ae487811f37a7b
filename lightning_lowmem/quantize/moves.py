"""How a tensor moves whole: the plain tensors a module's forward reads through it (its parts), and the same tensor
rebuilt around other parts (copies on a device, masters in pinned host memory).

A quantized weight is more than its storage: a torchao weight is a tensor subclass whose data are its inner tensors
(``__tensor_flatten__``), a bitsandbytes 4-bit weight keeps its scales in a ``quant_state`` beside its packed
data, an int8 one its row scales in ``SCB`` (and in its module's state after a first forward). Moving ``.data`` alone
leaves those where they were: on a GPU the forward would run CUDA kernels on host tensors. Each kind of tensor is a
:class:`Kind`, filed by :func:`register_kind` (the bitsandbytes ones in ``bnb_moves.py``):

::

    kind_of(tensor)                    the kind that moves it (plain tensors, tensor subclasses, bitsandbytes' weights)
    parts = kind.parts(tensor, owners) name -> plain tensor, everything its forward reads
    kind.build(tensor, parts)          a tensor of the same kind around ``parts`` (``tensor`` stays as it is)
    kind.attach(owner, built)          what a module keeps beside the tensor pointed at ``built``'s
    kind.keeps_object                  the module's Parameter object stays, its ``.data`` swapped (plain tensors);
                                       else ``built`` takes its place in the module

Example::

    >>> weight = torch.nn.Parameter(torch.ones(2, 2))
    >>> kind = kind_of(weight)
    >>> parts = {name: part.clone() for name, part in kind.parts(weight, []).items()}
    >>> list(parts), kind.build(weight, parts).data_ptr() == parts[""].data_ptr()
    ([''], True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


class Kind:
    """How one kind of tensor moves (see the module docstring)."""

    keeps_object: bool = False

    def claims(self, tensor: torch.Tensor) -> bool:
        raise NotImplementedError

    def parts(self, tensor: torch.Tensor, owners: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
        """Every plain tensor a forward reads through ``tensor`` (held by the modules ``owners``), by name."""
        raise NotImplementedError

    def build(self, tensor: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """A tensor like ``tensor`` (a Parameter for a Parameter) around ``parts``, on their device."""
        raise NotImplementedError

    def attach(self, owner: nn.Module, built: torch.Tensor) -> None:
        """Point what ``owner`` keeps beside the tensor at ``built``'s (nothing, for most kinds)."""
        return None


class Plain(Kind):
    """A plain tensor: itself. A Parameter keeps its object (ties and references to it hold); its ``.data`` moves."""

    keeps_object = True

    def claims(self, tensor: torch.Tensor) -> bool:
        return True

    def parts(self, tensor: torch.Tensor, owners: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
        return {"": tensor.detach()}

    def build(self, tensor: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return parts[""]


class Subclass(Kind):
    """A traceable tensor subclass (torchao's quantized weights): its inner tensors, opened recursively; rebuilt with
    its own ``__tensor_unflatten__``, on the device of its parts (a metadata record that names a device, as
    ``NF4Tensor``'s does, is given theirs)."""

    def claims(self, tensor: torch.Tensor) -> bool:
        return hasattr(type(tensor), "__tensor_flatten__") and hasattr(type(tensor), "__tensor_unflatten__")

    def parts(self, tensor: torch.Tensor, owners: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            inner = getattr(tensor, name)
            if self.claims(inner):
                found |= {f"{name}.{k}": v for k, v in self.parts(inner, owners).items()}
            else:
                found[name] = inner
        return found

    def build(self, tensor: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        built = self._unflatten(tensor, parts, "")
        return nn.Parameter(built, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else built

    def _unflatten(self, tensor: torch.Tensor, parts: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
        names, context = tensor.__tensor_flatten__()
        inner = {name: self._unflatten(getattr(tensor, name), parts, f"{prefix}{name}.")
                 if self.claims(getattr(tensor, name)) else parts[prefix + name] for name in names}
        device = next(iter(inner.values())).device
        return type(tensor).__tensor_unflatten__(inner, _on(context, device), tensor.size(), tensor.stride())


def _on(context: Any, device: torch.device) -> Any:
    """``context`` (a subclass's flattening metadata) with every dataclass in it that records a device given
    ``device``."""
    if isinstance(context, dict):
        return {k: _on(v, device) for k, v in context.items()}
    if dataclasses.is_dataclass(context) and not isinstance(context, type) \
            and any(f.name == "device" for f in dataclasses.fields(context)):
        return dataclasses.replace(context, device=device)
    return context


KINDS: list[Kind] = []
"""The kinds asked in turn, the first that claims a tensor moves it; :class:`Plain` last."""


def register_kind(kind: Kind) -> Kind:
    """File ``kind`` before the generic kinds (a library's own weights are claimed before a generic rule would)."""
    KINDS.insert(max(len(KINDS) - 2, 0), kind)
    return kind


KINDS += [Subclass(), Plain()]


def kind_of(tensor: torch.Tensor) -> Kind:
    """The kind that moves ``tensor``."""
    return next(kind for kind in KINDS if kind.claims(tensor))

