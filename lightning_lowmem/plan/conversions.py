"""Conversions of a checkpoint's names and layouts into a module's, chosen from what the module and the file are.

A checkpoint written by one library and a module built by another name the same tensors differently
(an HF checkpoint and litgpt's ``GPT``; a GGUF file and a transformers model; transformers' per-expert
MoE keys and its fused experts). A :class:`Converter` knows one such pair: given the module and the
checkpoint's headers, it returns a :class:`Conversion` (a key map, tensors combined from several keys,
a transform run on each tensor as read, ties to make on the module), or None when the pair is not its.

Converters are registered per model family or naming convention by the faces that know them (the
litgpt face registers HF and GGUF -> ``GPT``; the transformers face registers GGUF -> transformers and
per-expert -> fused MoE experts), and :func:`find_conversion` asks every one: the engine knows no family
by name. Two converters that both claim a pair is an error, never a guess.

Example::

    >>> class Upper(Converter):
    ...     name = "upper-case keys"
    ...     def convert(self, module, records, checkpoint):
    ...         if all(k.isupper() for k in records):
    ...             return Conversion(self.name, key_map=str.lower)
    >>> conversion = Upper().convert(nn.Linear(2, 2), {"WEIGHT": None, "BIAS": None}, None)
    >>> conversion.key_map("WEIGHT")
    'weight'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_lowmem.errors import CheckpointMismatchError, format_names
from lightning_lowmem.formats.records import TensorRecord
from lightning_lowmem.plan.combine import Combine, combined_record
from lightning_lowmem.plan.keys import KeyMap, apply_key_map, guess_prefix

Transform = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Conversion:
    """How one checkpoint's tensors become one module's.

    Attributes:
        name: what it converts, for logs, reports and ``inspect`` (``"HF -> litgpt (copy_weights_hf_llama)"``).
        key_map: checkpoint key -> module name (None drops the key on purpose).
        combine: module tensors built from several checkpoint keys.
        transform: ``transform(module_name, tensor)`` on each tensor as read (same shape).
        tie: makes module tensors that the conversion fills from one checkpoint tensor one tensor, before
            the plan is made (e.g. an output head the checkpoint does not hold is the embedding).
    """

    name: str
    key_map: KeyMap | None = None
    combine: Combine | None = None
    transform: Transform | None = None
    tie: Callable[[nn.Module], None] | None = None

    def apply_ties(self, module: nn.Module) -> None:
        """Make the ties this conversion needs on ``module`` (nothing without any)."""
        if self.tie is not None:
            self.tie(module)


def under(conversion: Conversion, prefix: str) -> Conversion:
    """``conversion`` made for a submodule, for the module holding it at ``prefix`` (``"model."``): every module
    name it gives or takes gets the prefix (a LightningModule holding the model as ``self.model``)."""
    if not prefix:
        return conversion
    key_map, combine, transform, tie = conversion.key_map, conversion.combine, conversion.transform, conversion.tie

    def prefixed_key_map(key: str) -> str | None:
        name = apply_key_map(key, key_map)
        return None if name is None else prefix + name

    return Conversion(
        conversion.name, key_map=prefixed_key_map,
        combine=None if combine is None else Combine({prefix + n: keys for n, keys in combine.sources.items()},
                                                     lambda name, parts: combine.fn(name[len(prefix):], parts),
                                                     {prefix + n: stack for n, stack in combine.stacks.items()}),
        transform=None if transform is None else (
            lambda name, t: transform(name[len(prefix):], t) if name.startswith(prefix) else t),
        tie=None if tie is None else (lambda module: tie(module.get_submodule(prefix[:-1]))))


def submodule_of(module: nn.Module, matches: Callable[[nn.Module], bool]) -> tuple[str, nn.Module] | None:
    """``(prefix, submodule)``: the first module in ``module`` (itself included) that ``matches``, and the prefix of
    its names in ``module`` (``""`` or ``"model."``); None when there is none."""
    for name, sub in module.named_modules():
        if matches(sub):
            return (f"{name}." if name else ""), sub
    return None


def tensors_filled(module_tensors: Mapping[str, torch.Tensor], records: Mapping[str, TensorRecord],
                   key_map: KeyMap | None, combine: Combine | None) -> int:
    """How many module tensors ``records`` fill with their own shape: renamed by ``key_map`` and built by ``combine``
    (``key_map`` None: the names as they are, a prefix guessed). A converter whose conversion fills no more than the
    names as they are returns none: a checkpoint already named as the module is read as it is.

    Example::

        >>> module = {"weight": torch.empty(2, 3, device="meta")}
        >>> records = {"model.weight": TensorRecord("model.weight", (2, 3), torch.float32, None)}
        >>> tensors_filled(module, records, None, None), tensors_filled(module, records, str.upper, None)
        (1, 0)
    """
    if key_map is None:
        key_map, _ = guess_prefix(set(module_tensors), list(records))
    filled = set()
    for key, rec in records.items():
        name = apply_key_map(key, key_map)
        if name in module_tensors and tuple(module_tensors[name].shape) == rec.shape:
            filled.add(name)
    for name in (combine.sources if combine is not None else ()):
        found = combined_record(combine, [name], records)
        if found.record is not None and found.record.shape == tuple(module_tensors[name].shape):
            filled.add(name)
    return len(filled)


class Converter:
    """One pair of naming conventions: a kind of module and a kind of checkpoint. Subclasses override
    :meth:`convert`; :attr:`name` says what they convert."""

    name: str = ""

    def convert(self, module: nn.Module, records: Mapping[str, TensorRecord], checkpoint: Any) -> Conversion | None:
        """The conversion of ``checkpoint`` into ``module``, or None when this pair is not this converter's.

        Args:
            module: the module being loaded (usually on meta).
            records: the checkpoint's records, each weight stored quantized seen as one record of its own shape
                (what a conversion learned from headers needs to see).
            checkpoint: the open :class:`~lightning_lowmem.formats.Checkpoint` (its files, metadata, GGUF header).
        """
        raise NotImplementedError


_CONVERTERS: list[Converter] = []


def register_converter(converter: Converter) -> Converter:
    """Ask ``converter`` about every load (registering the same type again replaces it)."""
    _CONVERTERS[:] = [c for c in _CONVERTERS if type(c) is not type(converter)]
    _CONVERTERS.append(converter)
    return converter


def find_conversion(module: nn.Module, records: Mapping[str, TensorRecord], checkpoint: Any) -> Conversion | None:
    """The one registered conversion of ``checkpoint`` into ``module``, or None (the names are taken as they are).

    Raises:
        CheckpointMismatchError: two converters claim the pair (two readings of one checkpoint).
    """
    found = [c for c in (converter.convert(module, records, checkpoint) for converter in _CONVERTERS)
             if c is not None]
    if len(found) > 1:
        raise CheckpointMismatchError(
            f"{getattr(checkpoint, 'description', 'The checkpoint')} can be read into {type(module).__name__} in "
            f"{len(found)} ways ({format_names([c.name for c in found])}); lightning_lowmem does not guess. Pass "
            "key_map= (and combine=, transform=) to say how its keys become the module's.")
    return found[0] if found else None
