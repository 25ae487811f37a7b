"""Checkpoints that hold weights already quantized: found from their headers, checked, and marked on the plan.

::

    stored = find_stored(records, metadata, read, requested=scheme)
        # keys and metadata only: which weights are stored quantized, in which scheme; a quantize= that
        # disagrees with the file fails here, before anything is read. Then each scheme reads what its
        # library keeps beside a weight (a bitsandbytes quant state: a few hundred bytes) and checks the parts.
    plan = make_plan(module, records, stored=stored.weights, combine=stored.expand(combine))
        # each stored weight is one target, matched by its own shape, whose parts are the stored tensors
    selection = mark_stored(module, plan, stored)
        # its Linear takes the scheme's module; the loader hands it the parts as they are read

Each library's stored layout (``layouts.py``: ``StoredLayout.find_stored``, ``resolve_stored``,
``load_stored``) knows its own tensors; this module asks every registered layout once, with no branch per
scheme. A tensor built from stored weights (an HF checkpoint's q, k and v fused
into litgpt's ``qkv``) is built from their dequantized values and quantized again in the same scheme,
one tensor at a time (:meth:`StoredWeights.expand`); the report lists it as requantized.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_lowmem.errors import CheckpointMismatchError, format_names
from lightning_lowmem.formats import TensorRecord
from lightning_lowmem.plan import Combine, LoadPlan, Target, records_as_themselves
from lightning_lowmem.quantize.layouts import LAYOUTS, StoredWeight, layout_of
from lightning_lowmem.quantize.schemes import SCHEMES, QuantScheme
from lightning_lowmem.quantize.selection import Selection

FULL_PRECISION = "stored in full precision in the checkpoint"


@dataclass
class StoredWeights:
    """The weights of a checkpoint stored already quantized, by key (see :func:`find_stored`)."""

    weights: dict[str, StoredWeight] = field(default_factory=dict)
    files: str = "the checkpoint"
    _owners: dict[str, StoredWeight] | None = field(default=None, init=False, repr=False)

    def __len__(self) -> int:
        return len(self.weights)

    @property
    def schemes(self) -> list[str]:
        """The names of the schemes the weights are stored in."""
        return sorted({w.scheme_name for w in self.weights.values()})

    def owner(self, key: str) -> StoredWeight | None:
        """The stored weight checkpoint key ``key`` is a part of, or None."""
        if self._owners is None:
            self._owners = {rec.key: w for w in self.weights.values() for rec in w.parts}
        return self._owners.get(key)

    def logical_records(self, records: Mapping[str, TensorRecord]) -> dict[str, TensorRecord]:
        """``records`` as if each stored weight were saved as itself: its parts replaced by one record of its
        own shape and dtype (what a conversion learned from headers, such as litgpt's, needs to see)."""
        return records_as_themselves(records, self.weights)

    def expand(self, combine: Combine | None) -> Combine | None:
        """``combine`` reading stored weights through their parts: each is dequantized, then combined as before."""
        if combine is None or not any(k in self.weights for keys in combine.sources.values() for k in keys):
            return combine
        weights, fn = self.weights, combine.fn
        sources = {name: tuple(part for key in keys for part in self._keys(key))
                   for name, keys in combine.sources.items()}

        def build(name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
            inputs = {}
            for key in combine.sources[name]:
                w = weights.get(key)
                inputs[key] = tensors[key] if w is None else layout_of(w.scheme).dequantize_stored(
                    w, {role: tensors[rec.key] for role, rec in w.roles.items()})
            return fn(name, inputs)

        return Combine(sources, build)

    def _keys(self, key: str) -> list[str]:
        w = self.weights.get(key)
        return [rec.key for rec in w.parts] if w is not None else [key]


def find_stored(records: Mapping[str, TensorRecord], metadata: Mapping[str, str],
                read: Callable[[str], torch.Tensor] | None, *, requested: QuantScheme | None = None,
                files: str = "the checkpoint") -> StoredWeights:
    """The weights ``records`` hold already quantized, checked.

    Args:
        records, metadata: the checkpoint's headers (``Checkpoint.records``, ``Checkpoint.metadata``).
        read: reads one checkpoint tensor by key (``Checkpoint.read``); None when only headers are at hand (a
            layout that keeps its state in a tensor, bitsandbytes 4-bit, then cannot be resolved).
        requested: the ``quantize=`` scheme; the file must agree with it.
        files: the checkpoint's files, for messages.

    Raises:
        CheckpointMismatchError: ``requested`` is not what the file holds (raised before anything is read).
        CheckpointFormatError: stored parts that do not fit together (named by key).
        UnsupportedQuantizationError: a stored layout no scheme here reads.
    """
    found: dict[str, StoredWeight] = {}
    for layout in LAYOUTS:
        found.update(layout.find_stored(records, metadata, files))
    _check_agrees(found, requested, files)
    for weight in found.values():
        if read is None and "quant_state" in weight.roles:
            raise ValueError(f"{files} holds {weight.key!r} quantized with its state in a tensor; pass the checkpoint "
                             "itself (a path or an open Checkpoint), not its records.")
        layout_of(SCHEMES[weight.scheme_name]).resolve_stored(weight, read, requested)
    return StoredWeights(found, files)


def _check_agrees(found: dict[str, StoredWeight], requested: QuantScheme | None, files: str) -> None:
    held = sorted({w.scheme_name for w in found.values()})
    if requested is None or not held or held == [requested.name]:
        return
    examples = [f"{w.key!r} ({w.scheme_name})" for w in found.values()]
    raise CheckpointMismatchError(
        f"{files} holds weights already quantized as {' and '.join(held)} ({format_names(examples, 3, quote=False)}), "
        f"but quantize={requested.name!r} was asked for; nothing was read. A pre-quantized checkpoint loads as it "
        f"was saved: pass quantize=None (or {held[0]!r}), or load a full-precision checkpoint to quantize it "
        f"with {requested.name!r}.")


def mark_stored(module: nn.Module, plan: LoadPlan, stored: StoredWeights) -> Selection:
    """Mark each target of ``plan`` made of stored weights with its scheme, and choose its Linear.

    A target stored as itself gets its weight's scheme and is loaded as stored; a target combined from
    stored weights gets the scheme of the first of them and is quantized again once built. Every other
    Linear stays in full precision, as the checkpoint holds it.

    Raises:
        CheckpointMismatchError: a stored weight goes to something that is not an ``nn.Linear`` weight.
    """
    selection: Selection | None = None
    for target in plan.targets:
        weight = target.stored or next(filter(None, (stored.owner(p.key) for p in target.parts)), None)
        if weight is None:
            continue
        module_name = _linear_name(module, target, weight, stored.files)
        target.scheme = weight.scheme
        selection = selection or Selection(weight.scheme)
        selection.chosen[module_name] = target.names[0]
        (selection.stored if target.stored is not None else selection.requantized).add(module_name)
    selection = selection or Selection(SCHEMES[stored.schemes[0]]())
    loaded = {name for target in plan.targets for name in target.names}
    for name, mod in module.named_modules():
        if type(mod) is nn.Linear and name not in selection.chosen and f"{name}.weight" in loaded:
            selection.left_out[name] = FULL_PRECISION
    return selection


def _linear_name(module: nn.Module, target: Target, weight: StoredWeight, files: str) -> str:
    """The name of the ``nn.Linear`` whose weight ``target`` is; anything else is a mismatch."""
    name = target.names[0]
    module_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(module_name) if module_name else module
    if type(owner) is not nn.Linear or leaf != "weight" or len(target.names) > 1 or not module_name:
        what = f"a {type(owner).__name__}'s {leaf!r}" + (" (tied)" if len(target.names) > 1 else "")
        raise CheckpointMismatchError(
            f"{files}: {weight.key!r} is stored quantized ({weight.scheme_name}) and goes to {name!r}, {what}, not "
            "the weight of an nn.Linear of its own: lightning_lowmem loads quantized weights into nn.Linear modules "
            "only. Build the model with an nn.Linear there, or load a full-precision checkpoint.")
    return module_name
