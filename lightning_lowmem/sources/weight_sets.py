"""A directory holding several weight sets: which one is read, and what was checked before saying so.

A checkpoint directory often holds the same weights twice: litgpt's ``lit_model.pth`` beside the HF files it
was converted from, ``model.safetensors`` beside ``pytorch_model.bin``, ``last.ckpt`` beside the epoch's
``.ckpt``. It may also hold two different ones: an older ``lit_model.pth`` beside a newer quantized copy, two
fine-tunes of one base. Which one a face reads must never depend on which face it is, and two sets are never
said to be the same unless every byte was compared. So the sets are compared:

* by headers: their tensors under the names the module takes them by (each set through its own conversion, so
  HF and litgpt names compare), their shapes and dtypes, and whether each is stored quantized. Any difference:
  an :class:`~lightning_lowmem.errors.AmbiguousCheckpointError` naming both sets, the difference and how to pick;
* by a sample of bytes (a small tensor whole, a larger one's first row): a difference is an error as above. Equal
  samples prove nothing about the rest;
* with ``verify_weight_sets=True``, by every byte of every tensor, as the module would get it (combined tensors
  built by their conversion, stored-quantized ones part by part): equal -> the sets hold the same tensors; any
  difference -> the error above. The cost is reading every set once, before the load.

Headers and samples agreeing, without ``verify_weight_sets``: the set whose names the module takes as they are
is read (no conversion), else the first in the documented order
(:data:`~lightning_lowmem.formats.discovery.WEIGHT_ORDER`), with an
:class:`~lightning_lowmem.errors.UnverifiedWeightsWarning` naming both sets and how to choose (``prefer=``,
``--weights``) or compare them (``verify_weight_sets=True``, ``--verify_weight_sets``). The Hub's own layout,
``model.safetensors`` (or its sharded index) beside ``pytorch_model.bin`` (or its index), is read as transformers'
``from_pretrained`` reads it, the safetensors, quietly: the load's one line at INFO says why, the rest unread.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from lightning_lowmem.errors import (
    AmbiguousCheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    NoStateDictError,
    UnverifiedWeightsWarning,
    format_names,
)
from lightning_lowmem.sources.entries import entry_for
from lightning_lowmem.sources.set_view import SetView
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.formats.discovery import WeightSet, weight_sets
from lightning_lowmem.memory import format_bytes

log = logging.getLogger(__name__)

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
    the path, why, and the entry of a torch file asked for (``entry=``); :func:`~lightning_lowmem.sources.resolve.
    resolved` opens it as chosen, without choosing again."""

    path: Path
    why: str
    entry: str | None = None


def choose_set(path: Path, module: nn.Module | None, prefer: str | None, stack: contextlib.ExitStack,
               verify: bool = False, entry: str | None = None) -> Choice:
    """The checkpoint ``path`` stands for, opened on ``stack``, and why it was chosen.

    Args:
        verify: compare every byte of the directory's weight sets (``verify_weight_sets``) instead of warning that
            they were compared by headers and samples only.
        entry: the entry of a torch file holding the weights (``entry=``; see ``sources/entries.py``).

    Raises:
        CheckpointNotFoundError: ``path`` does not exist or holds no weights.
        AmbiguousCheckpointError: several different weight sets (see the module docstring).
        ValueError: ``prefer`` names none of the directory's weight sets.

    Warns:
        UnverifiedWeightsWarning: several sets agree by headers and samples, and ``verify`` is off.
    """
    with entry_for(module, entry):  # a torch file's entry: the one asked, or the one that fits the module
        if not path.is_dir():
            return Choice(stack.enter_context(Checkpoint.open(path)), path, f"{path}: the file given")
        sets = candidate_sets(path, prefer)
        if len(sets) == 1:
            return Choice(stack.enter_context(Checkpoint.open(sets[0].path)), sets[0].path,
                          one_set_why(path, sets[0], prefer))
        opened = _open_sets(path, sets, stack)
        if len(opened) == 1:
            (weight_set, ckpt), = opened.items()
            return Choice(ckpt, weight_set.path, f"{weight_set.path}: the only weights in {path} (the other files "
                                                 "there hold no state dict)")
        views = [SetView.of(s, ckpt, module) for s, ckpt in opened.items()]
        for other in views[1:]:
            difference = views[0].difference(other)
            if difference:
                raise AmbiguousCheckpointError(_ambiguous_message(path, views[0].set, other.set, difference))
        chosen = next((v for v in views if v.native), views[0])
        by_names = module is not None and chosen.native and not all(v.native for v in views)
        reason = "the names the module takes as they are" if by_names else "the first in the documented order"
        others = [v for v in views if v is not chosen]
        if verify:
            return Choice(chosen.ckpt, chosen.set.path,
                          f"{chosen.set.path}: {reason}; {_verified(path, chosen, others)}")
        names = format_names((v.set.name for v in others), quote=False)
        if _hub_pair(chosen, others):  # the Hub's own layout: read quietly, as from_pretrained reads it (the load logs why)
            return Choice(chosen.ckpt, chosen.set.path,
                          f"{chosen.set.path}: the weights transformers' from_pretrained reads; {names} beside it "
                          "agrees by names, shapes, dtypes and sampled bytes, the rest unread (verify_weight_sets=True "
                          "checks every byte)")
        warnings.warn(_unverified_message(path, chosen, others, reason), UnverifiedWeightsWarning, stacklevel=2)
        return Choice(chosen.ckpt, chosen.set.path,
                      f"{chosen.set.path}: {reason}; {names} in {path} not compared byte for byte (names, shapes, "
                      "dtypes and sampled bytes agree; verify_weight_sets=True compares every byte)")


HUB_PAIR = ({"model.safetensors", "model.safetensors.index.json"}, {"pytorch_model.bin", "pytorch_model.bin.index.json"})
"""The two files of one model as the Hub serves it (transformers' ``save_pretrained`` in both formats)."""


def _hub_pair(chosen: SetView, others: list[SetView]) -> bool:
    """Whether ``chosen`` and ``others`` are the Hub's two files of one model, the safetensors chosen: transformers'
    ``from_pretrained`` reads the safetensors one without a word, so a load that agrees with it says at most one line."""
    return len(others) == 1 and chosen.set.name in HUB_PAIR[0] and others[0].set.name in HUB_PAIR[1]


def _open_sets(directory: Path, sets: list[WeightSet], stack: contextlib.ExitStack) -> dict[WeightSet, Checkpoint]:
    """Each set opened on ``stack`` (headers only); a torch file holding no state dict (a bare tensor saved beside
    the weights) is no weight set: left out, with a warning naming it.

    Raises:
        NoStateDictError: no set holds a state dict.
    """
    opened: dict[WeightSet, Checkpoint] = {}
    skipped: list[NoStateDictError] = []
    for weight_set in sets:
        try:
            opened[weight_set] = stack.enter_context(Checkpoint.open(weight_set.path))
        except NoStateDictError as e:
            skipped.append(e)
    if not opened:
        raise skipped[0]
    for e in skipped:
        warnings.warn(f"{e} It is not one of the weight sets of {directory}: left out "
                      f"({format_names((s.name for s in opened), quote=False)} considered).", UserWarning, stacklevel=3)
    return opened


def candidate_sets(directory: Path, prefer: str | None = None) -> list[WeightSet]:
    """The weight sets of ``directory`` (:func:`~lightning_lowmem.formats.discovery.weight_sets`) that ``prefer``
    names (all without it), each checked to be readable (an index's shards all there): a set ``prefer`` leaves out
    is not.

    Raises:
        CheckpointNotFoundError: ``directory`` does not exist or holds no weights; a shard a candidate index names
            is missing.
        CheckpointFormatError: a candidate index is malformed or names files outside the directory.
        ValueError: ``prefer`` names none of them.
    """
    if not directory.exists():
        raise CheckpointNotFoundError(f"Checkpoint {str(directory)!r} does not exist. Check the path.")
    sets = weight_sets(directory)
    if prefer is not None:
        found = [s for s in sets if s.name == prefer or (prefer in KINDS and _kind(s) == prefer)]
        if not found:
            raise ValueError(f"prefer={prefer!r} (--weights) names none of the weight sets in {directory} "
                             f"({format_names(s.name for s in sets)}); name one of them, or a format: "
                             f"{', '.join(KINDS)}.")
        sets, others = found, [s for s in sets if s not in found]
    else:
        others = sets
    for weight_set in sets:
        try:
            weight_set.check()
        except (CheckpointNotFoundError, CheckpointFormatError) as e:
            readable = [s.name for s in others if s is not weight_set and s.problem is None]
            if not readable:
                raise
            raise type(e)(f"{e} Or read another weight set of {directory}: prefer={readable[0]!r} (command line: "
                          f"--weights {readable[0]}).") from e
    return sets


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


def _unverified_message(directory: Path, chosen: SetView, others: list[SetView], reason: str) -> str:
    other = others[0].set.name
    total = sum(v.nbytes for v in (chosen, *others))
    return (f"{directory} holds {len(others) + 1} weight sets ({chosen.set.name} and "
            f"{format_names((v.set.name for v in others), quote=False)}) whose tensor names, shapes and dtypes agree, "
            f"and so do the bytes sampled from each; {chosen.set.name} is read ({reason}). The rest of their bytes "
            f"were not compared: {other} may hold other values. Pass prefer={chosen.set.name!r} (command line: "
            f"--weights {chosen.set.name}) to read it without this warning, or prefer={other!r} for the other; or "
            f"verify_weight_sets=True (--verify_weight_sets) to compare every byte first (reads "
            f"{format_bytes(total)}) and load only if they are the same.")


def _verified(directory: Path, chosen: SetView, others: list[SetView]) -> str:
    """Every byte of ``others`` compared with ``chosen``'s: what to say when they are the same.

    Raises:
        AmbiguousCheckpointError: the first difference.
    """
    read = 0
    for other in others:
        difference, nbytes = chosen.compare_bytes(other)
        read += nbytes
        if difference:
            raise AmbiguousCheckpointError(_ambiguous_message(directory, chosen.set, other.set, difference))
    names = format_names((v.set.name for v in others), quote=False)
    log.info("%s: every byte of %s compared with %s: the same (%s read)", directory, names, chosen.set.name,
             format_bytes(read))
    return (f"{names} in {directory} {'holds' if len(others) == 1 else 'hold'} the same tensors (every byte "
            f"compared, {format_bytes(read)} read)")
