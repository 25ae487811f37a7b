"""Which weights a checkpoint path stands for, and how their names become the module's: decided once, for every face.

::

    resolved(path, module, options)
        a file: itself.  a directory: its weight sets (formats.discovery.weight_sets)
            one set -> it;  several -> compared (sources.weight_sets): names as the module takes them,
            shapes, dtypes and a sample of every tensor's bytes
                the same tensors -> the first the module takes without a conversion, else the first in
                                    the documented order;  ``prefer=`` narrows the sets first
                different        -> AmbiguousCheckpointError naming both, and how to pick one
        -> opened (headers only) -> weights stored quantized (find_stored)
        -> the conversion of its names into the module's (plan.conversions: registered per model family)

``load_checkpoint``, ``placement_plan``, ``estimate_memory``, ``generate``, ``inspect``, the Fabric
strategies and the Trainer callback all call :func:`resolved`; nothing else decides these things.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from lightning_lowmem.sources.entries import entry_for
from lightning_lowmem.request.options import LoadOptions
from lightning_lowmem.formats.metadata_keys import TIES_KEY
from lightning_lowmem.errors import CheckpointFormatError, CheckpointNotFoundError
from lightning_lowmem.sources.weight_sets import Chosen, choose_set
from lightning_lowmem.formats import Checkpoint, TensorRecord
from lightning_lowmem.plan import Combine, KeyMap
from lightning_lowmem.plan.conversions import Conversion, Transform, find_conversion
from lightning_lowmem.quantize.stored import StoredWeights, find_stored
from lightning_lowmem.quiet import quietly

log = logging.getLogger(__name__)


@dataclass
class Source:
    """A checkpoint resolved for one module: the weights chosen and why, their headers, what they hold already
    quantized, and how their names become the module's.

    Attributes:
        records: every tensor record (headers only).
        description: the files, for messages.
        why: which weights were chosen and why (logged; shown by ``inspect`` and the load report).
        stored: the weights held already quantized.
        conversion: how the names become the module's (None: taken as they are, a prefix guessed).
        checkpoint: the open checkpoint, or None for records with no file behind them (a config's).
    """

    records: Mapping[str, TensorRecord]
    description: str = "the checkpoint"
    why: str = ""
    stored: StoredWeights = field(default_factory=StoredWeights)
    conversion: Conversion | None = None
    checkpoint: Checkpoint | None = None

    @property
    def key_map(self) -> KeyMap | None:
        return self.conversion.key_map if self.conversion is not None else None

    @property
    def combine(self) -> Combine | None:
        """The conversion's combined tensors, those built from weights stored quantized read through their parts."""
        combine = self.conversion.combine if self.conversion is not None else None
        return self.stored.expand(combine) if self.stored else combine

    @property
    def transform(self) -> Transform | None:
        return self.conversion.transform if self.conversion is not None else None

    @property
    def paths(self) -> list[Path]:
        return self.checkpoint.paths if self.checkpoint is not None else []

    @property
    def ties(self) -> dict[str, str]:
        """The tensors a save wrote once for two tied names: each name not written -> the key it was written under
        (``save_checkpoint`` records them in the metadata; none for other files).

        Raises:
            CheckpointFormatError: the record is not a JSON object of names to names.
        """
        text = self.checkpoint.metadata.get(TIES_KEY) if self.checkpoint is not None else None
        if text is None:
            return {}
        try:
            ties = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise CheckpointFormatError(f"{self.description}: the metadata {TIES_KEY!r} is not JSON ({e}).") from e
        if not isinstance(ties, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ties.items()):
            raise CheckpointFormatError(f"{self.description}: the metadata {TIES_KEY!r} must map tensor names to "
                                        f"tensor names; got {text[:200]!r}. Save the checkpoint again.")
        return ties


@contextlib.contextmanager
def resolved(checkpoint: str | Path | Checkpoint | Chosen, module: nn.Module | None,
             options: LoadOptions) -> Iterator[Source]:
    """``checkpoint`` resolved for ``module`` under ``options``, open for the block (an open
    :class:`Checkpoint` passed in is left open).

    Args:
        checkpoint: a file, an index, a directory, an open :class:`Checkpoint`, or weights a face already chose
            (:class:`~lightning_lowmem.sources.weight_sets.Chosen`).
        module: the module the weights go to (its names decide between weight sets holding the same tensors,
            and which conversion applies); None: names are taken as they are.
        options: the load options: ``prefer`` picks among weight sets, ``quantize`` is checked against
            weights stored quantized, an explicit ``key_map``/``combine``/``transform`` replaces the conversion.

    Raises:
        AmbiguousCheckpointError: a directory holds different weight sets and ``prefer`` picks none of them.
        CheckpointMismatchError: ``quantize`` disagrees with what the file holds; two conversions claim the pair.
    """
    with contextlib.ExitStack() as stack:
        if isinstance(checkpoint, Checkpoint):
            ckpt, why = checkpoint, f"{checkpoint.description}: opened by the caller"
        elif isinstance(checkpoint, Chosen):
            with entry_for(module, options.entry if options.entry is not None else checkpoint.entry):
                ckpt, why = stack.enter_context(Checkpoint.open(checkpoint.path)), checkpoint.why
        else:
            path = Path(checkpoint).expanduser()
            if not path.exists():
                raise CheckpointNotFoundError(f"Checkpoint {str(path)!r} does not exist. Check the path.")
            choice = choose_set(path, module, options.prefer, stack, verify=options.verify_weight_sets,
                                entry=options.entry)
            ckpt, why = choice.checkpoint, choice.why
        log.info("Checkpoint: %s", why)
        source = source_of(ckpt, module, options, why)
        del module  # a model that keeps this checkpoint open (disk_offload) is not kept alive by it
        yield source


@contextlib.contextmanager
def opened(checkpoint: str | Path | Checkpoint, module: nn.Module | None = None,
           prefer: str | None = None, verify: bool = False, entry: str | None = None) -> Iterator[Checkpoint]:
    """The checkpoint a path stands for (chosen as :func:`resolved` chooses it, ``verify`` as
    ``verify_weight_sets``, ``entry`` as the option), open for the block; an open :class:`Checkpoint` is passed
    through and left open."""
    if isinstance(checkpoint, Checkpoint):
        yield checkpoint
        return
    with contextlib.ExitStack() as stack:
        yield choose_set(Path(checkpoint).expanduser(), module, prefer, stack, verify, entry).checkpoint


@quietly
def source_of(ckpt: Checkpoint, module: nn.Module | None, options: LoadOptions, why: str = "") -> Source:
    """The :class:`Source` of an open checkpoint for ``module``: its stored weights and its conversion."""
    stored = find_stored(ckpt.records, ckpt.metadata, ckpt.read, requested=options.scheme, files=ckpt.description)
    return Source(ckpt.records, ckpt.description, why, stored, conversion_of(ckpt, stored, module, options), ckpt)


def conversion_of(ckpt: Checkpoint, stored: StoredWeights, module: nn.Module | None,
                  options: LoadOptions) -> Conversion | None:
    """The conversion a load of ``ckpt`` into ``module`` applies: the one the options spell out, else the
    registered one for this module and file (None: names as they are)."""
    if options.key_map is not None or options.combine is not None or options.transform is not None:
        return Conversion("given in the load options", options.key_map, options.combine, options.transform)
    if module is None:
        return None
    return find_conversion(module, stored.logical_records(ckpt.records), ckpt)


def records_source(records: Mapping[str, TensorRecord], options: LoadOptions, description: str) -> Source:
    """A :class:`Source` of records with no file behind them (a config's own tensors, a module's): no stored
    weights; the options' key map, combine and transform, if any, as the conversion."""
    conversion = None
    if options.key_map is not None or options.combine is not None or options.transform is not None:
        conversion = Conversion("given in the load options", options.key_map, options.combine, options.transform)
    return Source(records, description, description, conversion=conversion)
