"""One weight set of a directory as the module would take it, and what comparing two of them reads: the view
:mod:`~lightning_lowmem.sources.weight_sets` compares sets through (by headers, a sample of bytes, or every byte)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_lowmem.errors import format_names
from lightning_lowmem.formats import Checkpoint, TensorRecord
from lightning_lowmem.formats.discovery import WeightSet
from lightning_lowmem.plan import Combine, apply_key_map, guess_prefix
from lightning_lowmem.plan.combine import combined_record
from lightning_lowmem.plan.conversions import Transform, find_conversion
from lightning_lowmem.quantize.stored import StoredWeight, find_stored

SAMPLE_BYTES = 64 * 2**10
"""A tensor up to this size is sampled whole; a larger one by its first row."""


@dataclass
class SetView:
    """One weight set as the module would take it: module name -> the record that fills it (as stored)."""

    set: WeightSet
    ckpt: Checkpoint
    native: bool
    plain: dict[str, TensorRecord] = field(default_factory=dict)
    built: dict[str, tuple[int, ...]] = field(default_factory=dict)
    stored: dict[str, StoredWeight] = field(default_factory=dict)
    combine: Combine | None = None
    transform: Transform | None = None
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Module name -> the other names of the same tensor in the module (a head tied to its embedding)."""

    @classmethod
    def of(cls, weight_set: WeightSet, ckpt: Checkpoint, module: nn.Module | None) -> SetView:
        stored = find_stored(ckpt.records, ckpt.metadata, ckpt.read, files=ckpt.description)
        records = stored.logical_records(ckpt.records)
        conversion = find_conversion(module, records, ckpt) if module is not None else None
        key_map = conversion.key_map if conversion is not None else None
        if conversion is None and module is not None:
            key_map = guess_prefix(set(module.state_dict(keep_vars=True)), list(records))[0]
        view = cls(weight_set, ckpt, native=conversion is None, aliases=_aliases(module))
        for key, rec in records.items():
            name = apply_key_map(key, key_map)
            if name is not None:
                view.plain[name] = rec
                if key in stored.weights:
                    view.stored[name] = stored.weights[key]
        if conversion is not None and conversion.combine is not None:
            view.combine, view.transform = stored.expand(conversion.combine), conversion.transform
            for name in conversion.combine.sources:
                found = combined_record(conversion.combine, [name], records)
                view.built[name] = found.record.shape if found.record is not None else ()
        elif conversion is not None:
            view.transform = conversion.transform
        return view

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the set's files hold (what comparing every byte reads of it)."""
        return sum(rec.tensor_nbytes for rec in self.ckpt.records.values())

    def difference(self, other: SetView) -> str:
        """The first way ``other`` holds other tensors than this one by headers and sampled bytes, or ``""``."""
        mine, theirs = {**self.shapes(), **self.built}, {**other.shapes(), **other.built}
        pairs, only = self.pairs(other)
        if only:
            return f"{len(only)} tensors are in one and not the other ({format_names(only, 3)})"
        compared = 0
        for name, their_name in pairs:
            if mine[name] != theirs[their_name]:
                return f"{name!r} is {list(mine[name])} in one and {list(theirs[their_name])} in the other"
            a, b = self.plain.get(name), other.plain.get(their_name)
            if a is None or b is None or name in self.built or their_name in other.built:
                continue
            if (a.dtype, self._scheme(name)) != (b.dtype, other._scheme(their_name)):
                return (f"{name!r} is {self._form(name)} in {self.set.name} and {other._form(their_name)} in "
                        f"{other.set.name}")
            samples = (_sample(self.ckpt, a), _sample(other.ckpt, b)) if name not in self.stored else (None, None)
            if samples[0] is not None and samples[1] is not None:
                if not _same_bytes(*samples):
                    return f"the values of {_pair_name(name, their_name, other)} differ"
                compared += 1
        return "" if compared else "no tensor of one could be compared with the other's"

    def pairs(self, other: SetView) -> tuple[list[tuple[str, str]], list[str]]:
        """Each tensor of this set with the one of ``other`` that fills the same module tensor (its own name, or a
        name tied to it in the module where one set holds a tied tensor once and the other twice); and the names
        neither way matches."""
        mine, theirs = {*self.shapes(), *self.built}, {*other.shapes(), *other.built}
        pairs: dict[tuple[str, str], None] = {}
        only = []
        for name in sorted(mine | theirs):
            a = name if name in mine else next((n for n in self.aliases.get(name, ()) if n in mine), None)
            b = name if name in theirs else next((n for n in other.aliases.get(name, ()) if n in theirs), None)
            if a is None or b is None:
                only.append(name)
            else:
                pairs[a, b] = None
        return list(pairs), only

    def compare_bytes(self, other: SetView) -> tuple[str, int]:
        """The first tensor whose bytes differ between the two sets (``""`` if none), and the bytes read; one
        tensor of each at a time."""
        read = 0
        for name, their_name in self.pairs(other)[0]:
            for (role, a), (_, b) in zip(self.pieces(name), other.pieces(their_name), strict=True):
                read += _stored_nbytes(a) + _stored_nbytes(b)
                if not _same_bytes(a, b):
                    what = _pair_name(name, their_name, other) + (f" ({role})" if role else "")
                    return f"the bytes of {what} differ (every byte compared)", read
        return "", read

    def pieces(self, name: str) -> Iterator[tuple[str, torch.Tensor]]:
        """What the module gets for ``name`` from this set, read now: a stored-quantized weight's parts by role, else
        the tensor (built by the conversion, rewritten by its transform)."""
        if name in self.stored and name not in self.built:
            for role, rec in sorted(self.stored[name].roles.items()):
                yield role, self.ckpt.read(rec.key)
            return
        if name in self.built:
            tensor = self.combine.fn(name, {key: self.ckpt.read(key) for key in self.combine.sources[name]})
        else:
            tensor = self.ckpt.read(self.plain[name].key)
        yield "", self.transform(name, tensor) if self.transform is not None else tensor

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: rec.shape for name, rec in self.plain.items()}

    def _scheme(self, name: str) -> str | None:
        weight = self.stored.get(name)
        return weight.scheme_name if weight is not None else None

    def _form(self, name: str) -> str:
        scheme = self._scheme(name)
        return f"quantized ({scheme})" if scheme else str(self.plain[name].dtype).removeprefix("torch.")


def _pair_name(name: str, their_name: str, other: SetView) -> str:
    """``name``, and the name the other set holds it under where that is another name of the same tensor."""
    tied = f" ({their_name!r} in {other.set.name}, tied to it)" if their_name != name else ""
    return repr(name) + tied


def _aliases(module: nn.Module | None) -> dict[str, tuple[str, ...]]:
    """Each name of ``module`` that shares its tensor with other names -> those names."""
    if module is None:
        return {}
    groups: dict[int, list[str]] = {}
    for name, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(tensor), []).append(name)
    return {n: tuple(m for m in names if m != n) for names in groups.values() if len(names) > 1 for n in names}


def _sample(ckpt: Checkpoint, rec: TensorRecord) -> torch.Tensor | None:
    """A tensor whole when small, else its first row; None when neither is cheap to read."""
    if rec.tensor_nbytes <= SAMPLE_BYTES:
        return ckpt.read(rec.key)
    if len(rec.shape) >= 2 and rec.shape[0] > 0 and ckpt.reads_rows(rec.key):
        return ckpt.read_rows(rec.key, 0, 1)
    return None


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same shape, dtype and bytes (NaNs and signed zeros compared as bytes)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(_as_bytes(a), _as_bytes(b))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t


def _stored_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
