"""A directory holding several weight sets: the same tensors (read the one the module takes best), or not (an error).

A checkpoint directory often holds the same weights twice: litgpt's ``lit_model.pth`` beside the HF files it
was converted from, ``model.safetensors`` beside ``pytorch_model.bin``, ``last.ckpt`` beside the epoch's
``.ckpt``. It may also hold two different ones: an older ``lit_model.pth`` beside a newer quantized copy.
Which one a face reads must never depend on which face it is, and never be a guess. So the sets are
compared, from headers and a sample of bytes:

* their tensors under the names the module takes them by (each set through its own conversion, so HF and
  litgpt names compare), with their shapes and dtypes, and whether each is stored quantized;
* the bytes of a sample of every tensor both hold as stored: the first row (a small tensor whole).

The same tensors: the set whose names the module takes as they are is read (no conversion), else the first
in the documented order (:data:`~lightning_lowmem.formats.discovery.WEIGHT_ORDER`). Different ones: an
:class:`~lightning_lowmem.errors.AmbiguousCheckpointError` naming both, the first difference, and how to
pick (``prefer=``, ``--weights``, or the file's own path).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lightning_lowmem.errors import AmbiguousCheckpointError, CheckpointNotFoundError, format_names
from lightning_lowmem.formats import Checkpoint, TensorRecord
from lightning_lowmem.formats.discovery import WeightSet, weight_sets
from lightning_lowmem.plan import apply_key_map, guess_prefix
from lightning_lowmem.plan.combine import combined_record
from lightning_lowmem.plan.conversions import find_conversion
from lightning_lowmem.quantize.stored import find_stored

SAMPLE_BYTES = 64 * 2**10
"""A tensor up to this size is compared whole; a larger one by its first row."""

KINDS = {"safetensors": (".safetensors",), "torch": (".pth", ".pt", ".bin", ".ckpt"), "gguf": (".gguf",)}
"""What ``prefer=`` may name besides a file: a format, told by the weight files' names."""


@dataclass(frozen=True)
class Choice:
    """The weights a path stands for: opened, the file (or index) they are, and why they were chosen."""

    checkpoint: Checkpoint
    path: Path
    why: str


@dataclass(frozen=True)
class Chosen:
    """A weight set a face chose before it could build its model (litgpt's config is found beside the weights):
    the path, and why; :func:`~lightning_lowmem.engine.resolve.resolved` opens it as chosen, without choosing
    again."""

    path: Path
    why: str


def choose_set(path: Path, module: nn.Module | None, prefer: str | None, stack: contextlib.ExitStack) -> Choice:
    """The checkpoint ``path`` stands for, opened on ``stack``, and why it was chosen.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist or holds no weights.
        AmbiguousCheckpointError: several different weight sets (see the module docstring).
        ValueError: ``prefer`` names none of the directory's weight sets.
    """
    if not path.is_dir():
        return Choice(stack.enter_context(Checkpoint.open(path)), path, f"{path}: the file given")
    sets = candidate_sets(path, prefer)
    if len(sets) == 1:
        return Choice(stack.enter_context(Checkpoint.open(sets[0].path)), sets[0].path, one_set_why(path, sets[0], prefer))
    views = [_View.of(s, stack.enter_context(Checkpoint.open(s.path)), module) for s in sets]
    for other in views[1:]:
        difference = views[0].difference(other)
        if difference:
            raise AmbiguousCheckpointError(_ambiguous_message(path, views[0].set, other.set, difference))
    chosen = next((v for v in views if v.native), views[0])
    by_names = module is not None and chosen.native and not all(v.native for v in views)
    reason = "the names the module takes as they are" if by_names else "the first in the documented order"
    same = format_names((v.set.name for v in views if v is not chosen), quote=False)
    return Choice(chosen.ckpt, chosen.set.path, f"{chosen.set.path}: {reason}; {same} in {path} hold the same tensors")


def candidate_sets(directory: Path, prefer: str | None = None) -> list[WeightSet]:
    """The weight sets of ``directory`` (:func:`~lightning_lowmem.formats.discovery.weight_sets`) that ``prefer``
    names (all without it).

    Raises:
        CheckpointNotFoundError: ``directory`` does not exist or holds no weights.
        ValueError: ``prefer`` names none of them.
    """
    if not directory.exists():
        raise CheckpointNotFoundError(f"Checkpoint {str(directory)!r} does not exist. Check the path.")
    sets = weight_sets(directory)
    if prefer is None:
        return sets
    found = [s for s in sets if s.name == prefer or (prefer in KINDS and _kind(s) == prefer)]
    if not found:
        raise ValueError(f"prefer={prefer!r} (--weights) names none of the weight sets in {directory} "
                         f"({format_names(s.name for s in sets)}); name one of them, or a format: {', '.join(KINDS)}.")
    return found


def one_set_why(directory: Path, chosen: WeightSet, prefer: str | None) -> str:
    """Why ``chosen``, the one set :func:`candidate_sets` left: the only weights in ``directory``, or the one ``prefer``
    asked for among several."""
    count = len(weight_sets(directory)) if prefer is not None else 1
    if count == 1:
        return f"{chosen.path}: the only weights in {directory}"
    return f"{chosen.path}: chosen as asked ({prefer!r}) among the {count} weight sets in {directory}"


def _kind(weight_set: WeightSet) -> str:
    name = weight_set.shards[0].name if weight_set.shards else weight_set.name
    return next((kind for kind, suffixes in KINDS.items() if name.endswith(suffixes)), "")


def _ambiguous_message(directory: Path, first: WeightSet, second: WeightSet, difference: str) -> str:
    return (f"{directory} holds two different weight sets, {first.name} and {second.name}: {difference}. "
            "lightning_lowmem does not guess which one is meant. Pass the file to load (e.g. "
            f"{directory / second.name}), or prefer={second.name!r} (command line: --weights {second.name}); or "
            "remove the one that is stale.")


@dataclass
class _View:
    """One weight set as the module would take it: module name -> the record that fills it (as stored)."""

    set: WeightSet
    ckpt: Checkpoint
    native: bool
    plain: dict[str, TensorRecord] = field(default_factory=dict)
    built: dict[str, tuple[int, ...]] = field(default_factory=dict)
    stored: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, weight_set: WeightSet, ckpt: Checkpoint, module: nn.Module | None) -> _View:
        stored = find_stored(ckpt.records, ckpt.metadata, ckpt.read, files=ckpt.description)
        records = stored.logical_records(ckpt.records)
        conversion = find_conversion(module, records, ckpt) if module is not None else None
        key_map = conversion.key_map if conversion is not None else None
        if conversion is None and module is not None:
            key_map = guess_prefix(set(module.state_dict(keep_vars=True)), list(records))[0]
        view = cls(weight_set, ckpt, native=conversion is None)
        for key, rec in records.items():
            name = apply_key_map(key, key_map)
            if name is not None:
                view.plain[name] = rec
                if key in stored.weights:
                    view.stored[name] = stored.weights[key].scheme_name
        if conversion is not None and conversion.combine is not None:
            for name in conversion.combine.sources:
                found = combined_record(conversion.combine, [name], records)
                view.built[name] = found.record.shape if found.record is not None else ()
        return view

    def difference(self, other: _View) -> str:
        """The first way ``other`` holds other tensors than this one, or ``""`` when it holds the same."""
        mine, theirs = {**self.shapes(), **self.built}, {**other.shapes(), **other.built}
        if set(mine) != set(theirs):
            only = sorted(set(mine) ^ set(theirs))
            return f"{len(only)} tensors are in one and not the other ({format_names(only, 3)})"
        compared = 0
        for name, shape in mine.items():
            if shape != theirs[name]:
                return f"{name!r} is {list(shape)} in one and {list(theirs[name])} in the other"
            a, b = self.plain.get(name), other.plain.get(name)
            if a is None or b is None or name in self.built or name in other.built:
                continue
            if (a.dtype, self.stored.get(name)) != (b.dtype, other.stored.get(name)):
                return (f"{name!r} is {self._form(name)} in {self.set.name} and {other._form(name)} in "
                        f"{other.set.name}")
            samples = (_sample(self.ckpt, a), _sample(other.ckpt, b)) if name not in self.stored else (None, None)
            if samples[0] is not None and samples[1] is not None:
                if not torch.equal(*samples):
                    return f"the values of {name!r} differ"
                compared += 1
        return "" if compared else "no tensor of one could be compared with the other's"

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: rec.shape for name, rec in self.plain.items()}

    def _form(self, name: str) -> str:
        scheme = self.stored.get(name)
        return f"quantized ({scheme})" if scheme else str(self.plain[name].dtype).removeprefix("torch.")


def _sample(ckpt: Checkpoint, rec: TensorRecord) -> torch.Tensor | None:
    """A tensor whole when small, else its first row; None when neither is cheap to read."""
    if rec.tensor_nbytes <= SAMPLE_BYTES:
        return ckpt.read(rec.key)
    if len(rec.shape) >= 2 and rec.shape[0] > 0 and ckpt.reads_rows(rec.key):
        return ckpt.read_rows(rec.key, 0, 1)
    return None
