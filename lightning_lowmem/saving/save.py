"""``save_checkpoint``: what a module holds, full precision or quantized, as safetensors in transformers' layout.

::

    walk the module: a quantized module -> its library's tensors (``StoredLayout.state_dict_of``)
                     any other module   -> its own parameters and persistent buffers (tied ones once)
    -> shapes and dtypes first: the files' headers, cut into shards of ``max_shard_size``
    -> each tensor asked for, copied to CPU if it has to be, written, dropped; the next

The files load back with :func:`~lightning_lowmem.load_checkpoint` as they are, nothing quantized again, and
with transformers' ``from_pretrained`` where transformers reads the scheme (a transformers model also gets its
``config.json``, with the ``quantization_config`` transformers needs).

The directory is replaced as a whole (:mod:`~lightning_lowmem.saving.save_target`): everything is written
into a new directory beside it, then switched in with one rename, so that a kill or a full disk at any moment
leaves the complete old checkpoint or the complete new one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lightning_lowmem.dtypes import model_dtype
from lightning_lowmem.errors import MetaTensorError, UnsupportedQuantizationError, format_names
from lightning_lowmem.formats.metadata_keys import TIES_KEY
from lightning_lowmem.saving.atomic_file import copy_new
from lightning_lowmem.saving.safetensors_writer import (  # SCHEME_KEY: still importable from here
    SCHEME_KEY,
    WRITER,
    WRITER_KEY,
    TensorToWrite,
    plan_sharded,
    write_sharded,
)
from lightning_lowmem.saving.save_target import checkpoint_directory, is_weight_file
from lightning_lowmem.memory.units import parse_bytes
from lightning_lowmem.meta import fabric_unwrapped
from lightning_lowmem.placement import architecture_of
from lightning_lowmem.quantize import LAYOUTS, QuantScheme, layout_of, scheme_of
from lightning_lowmem.quantize.selection import as_linear
from lightning_lowmem.runtime.disk_model import on_disk_modules



@dataclass
class ModuleState:
    """What :func:`save_checkpoint` writes of a module, known before anything is written.

    Attributes:
        tensors: every tensor to write, in module order (each made when it is written).
        metadata: the text every file carries (``format``, the scheme, what the scheme's library needs).
        quantized: quantized module name -> (its scheme, the module).
        full_precision: the ``nn.Linear`` (and transformers ``Conv1D``) modules kept in full precision.
        ties: each tied name not written -> the name its tensor is written under (in the metadata as
            :data:`TIES_KEY`, so that a load ties them again).
    """

    tensors: list[TensorToWrite] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    quantized: dict[str, tuple[QuantScheme, nn.Module]] = field(default_factory=dict)
    full_precision: list[str] = field(default_factory=list)
    ties: dict[str, str] = field(default_factory=dict)

    def materialized(self) -> dict[str, torch.Tensor]:
        """Every tensor, made now (for a single torch file; a safetensors file is written one tensor at a time)."""
        return {t.key: t.get() for t in self.tensors}


def save_checkpoint(module: nn.Module, path: str | Path, *, max_shard_size: int | str = "5GB", overwrite: bool = False,
                    copy_files: Sequence[str | Path] = ()) -> list[Path]:
    """Write what ``module`` holds, quantized or not, into the directory ``path`` as safetensors.

    Quantized layers are written as their library stores them, in the layout transformers saves for the same
    library (bitsandbytes: packed weight, ``absmax``, ``quant_map``, the quant state's JSON; torchao: the
    inner tensors and the metadata of torchao's safetensors flattening). One tensor is made and written at a
    time: the peak is the model plus about one tensor. Every file's metadata has ``format: pt``,
    ``lightning_lowmem.writer`` and, for a quantized model, ``lightning_lowmem.quantize`` (the scheme). A
    transformers model also gets its ``config.json`` (with its ``quantization_config``), a litgpt ``GPT`` its
    ``model_config.yaml``.

    The directory is replaced as a whole: the new files are written into a new directory beside it (each
    created fresh, never through a link, and fsynced), what the old directory holds beyond them is carried
    over (a README, tokenizer files, links), and the new directory is switched in with one atomic rename.
    Whatever the moment of a kill or a full disk, ``path`` holds the complete old checkpoint or the complete
    new one. The old save's files that the new one does not have (``model.safetensors`` after a sharded save,
    shards after a single file) go with the old directory.

    Args:
        module: the module to save (or what ``fabric.setup`` made of it); nothing of it may be on the meta
            device.
        path: a directory (made if missing; a link to a directory writes the directory it names).
        max_shard_size: bytes per file (an int, or ``"5GB"``, ``"500MiB"``); past it the tensors are split
            over several files named as ``save_pretrained`` names them, with ``model.safetensors.index.json``.
        overwrite: remove weight files in ``path`` that lightning_lowmem did not write (``lit_model.pth``,
            ``pytorch_model.bin``, other ``*.safetensors``, ``*.gguf``) when the new save is switched in.
            Without it they make the save fail before anything is written.
        copy_files: files copied into the directory with the weights, in the same switch (a tokenizer, a
            prompt style): read through any link, written as new files under their own names.

    Returns:
        The files written (the index last, when there is one).

    Raises:
        MetaTensorError: tensors of ``module`` are still on meta.
        ForeignWeightsError: ``path`` holds weight files this library did not write and ``overwrite`` is False.
        SaveError: ``path`` cannot be written (not writable, a mount point), the file system has too little
            free space (checked before anything is written), or a write failed; the message names the file,
            the bytes needed and free, and ``path`` holds what it held before.

    Example::

        >>> import tempfile
        >>> directory = tempfile.mkdtemp()
        >>> [p.name for p in save_checkpoint(nn.Linear(4, 2), directory)]
        ['model.safetensors']
    """
    directory = Path(path).expanduser()
    if directory.suffix in (".safetensors", ".json"):
        raise ValueError(f"save_checkpoint writes a directory (as save_pretrained does); {str(path)!r} names a "
                         "file. Pass the directory to write model.safetensors into.")
    copies = _copies(copy_files)
    module = fabric_unwrapped(module)
    state = module_state(module)
    plan = plan_sharded(state.tensors, state.metadata, parse_bytes(max_shard_size, name="max_shard_size"))
    sizes = [*plan.sizes, *(source.stat().st_size for source in copies)]
    with checkpoint_directory(directory, sizes=sizes, overwrite=overwrite) as new:
        written = write_sharded(new, plan)
        architecture_of(module).save_config(module, new, transformers_config(module, state))
        for source in copies:
            copy_new(source, new / source.name)
    return [directory / p.name for p in written]


def _copies(copy_files: Sequence[str | Path]) -> list[Path]:
    """The files to copy beside the weights, checked: each a file, none of them weights, no name twice."""
    copies = [Path(p).expanduser() for p in copy_files]
    names = [p.name for p in copies]
    bad = [str(p) for p in copies if not p.is_file() or is_weight_file(p)]
    if bad or len(set(names)) < len(names):
        raise ValueError(f"copy_files takes files to put beside the weights (a tokenizer, a config), each once and "
                         f"none of them weights; got {format_names(bad or names)}.")
    return copies


def module_state(module: nn.Module) -> ModuleState:
    """What :func:`save_checkpoint` writes of ``module``: its tensors (made when written) and metadata.

    Raises:
        MetaTensorError: tensors of ``module`` are still on meta.
    """
    module = fabric_unwrapped(module)  # its names, not the wrapper's
    _refuse_parametrized(module)
    _refuse_on_disk(module)
    state, seen, on_meta = ModuleState(), {}, []
    cache = _Latest()
    for name, mod in module.named_modules():
        prefix = f"{name}." if name else ""
        scheme = scheme_of(mod)
        if scheme is not None:
            state.quantized[name] = (scheme, mod)
            for key, tensor in layout_of(scheme).state_dict_of(mod).items():  # shapes now; again when written
                state.tensors.append(TensorToWrite(prefix + key, tuple(tensor.shape), tensor.dtype,
                                                   cache.getter(mod, scheme, key)))
            seen.update((id(t), f"{prefix}{leaf}") for leaf, t in mod.named_parameters(recurse=False))
            continue
        if as_linear(mod)[0] is not None:  # an nn.Linear (or transformers' Conv1D) kept in full precision
            state.full_precision.append(name)
        for leaf, tensor in _own_tensors(mod):
            if id(tensor) in seen:
                state.ties[prefix + leaf] = seen[id(tensor)]  # tied: saved once, under its first name
                continue
            seen[id(tensor)] = prefix + leaf
            if tensor.is_meta:
                on_meta.append(prefix + leaf)
            else:
                state.tensors.append(TensorToWrite.of(prefix + leaf, tensor.detach()))
    if on_meta:
        raise MetaTensorError(f"Cannot save {type(module).__name__}: {len(on_meta)} tensors are still on the meta "
                              f"device ({format_names(on_meta)}), so there is nothing to write for them. Load its "
                              "weights first (load_checkpoint), then save.")
    state.metadata = _metadata(state)
    return state


def _refuse_parametrized(module: nn.Module) -> None:
    """Raise for parameters held through a parametrization (quantized MoE expert stacks): their scales live in the
    parametrization, which no layout here writes yet; writing the packed codes alone would save a broken file."""
    held = [f"{name}.{leaf}" if name else leaf for name, mod in module.named_modules()
            for leaf in getattr(mod, "parametrizations", {})]
    if held:
        raise UnsupportedQuantizationError(
            f"Cannot save {type(module).__name__}: {format_names(held)} are held through a parametrization (expert "
            "stacks quantized by bitsandbytes 4-bit), which save_checkpoint does not write yet. Save the model "
            "loaded in full precision and pass quantize= when loading it; nothing was written.")


def _refuse_on_disk(module: nn.Module) -> None:
    """Raise for modules whose tensors are read from their checkpoint for each forward (``disk_offload``): between
    forwards they hold placeholders, which a save would write as weights."""
    on_disk = on_disk_modules(module)
    if on_disk:
        raise ValueError(
            f"Cannot save {type(module).__name__}: {len(on_disk)} of its modules ({format_names(on_disk, 3)}) are read "
            f"from {next(iter(on_disk.values()))} for each forward (disk_offload) and hold no weights between "
            "forwards (placeholders), which a save would write as weights; nothing was written. That file already "
            "holds them: copy it, or load the model without disk_offload (or quantized, with quantize=, so that it "
            "fits) to save it.")


def transformers_config(module: nn.Module, state: ModuleState) -> dict | None:
    """The ``quantization_config`` transformers reads ``state``'s quantized weights with; None when the module is
    not quantized, mixes schemes, or transformers cannot read its scheme."""
    schemes = {scheme.name: (scheme, mod) for scheme, mod in state.quantized.values()}
    if len(schemes) != 1:
        return None
    scheme, mod = next(iter(schemes.values()))
    compute = getattr(mod, "compute_dtype", None)
    compute = compute if isinstance(compute, torch.dtype) else model_dtype(module)
    return layout_of(scheme).transformers_config(scheme, state.full_precision, compute)


def _metadata(state: ModuleState) -> dict[str, str]:
    metadata = {"format": "pt", WRITER_KEY: WRITER}
    if state.ties:
        metadata[TIES_KEY] = json.dumps(state.ties)
    if state.quantized:
        metadata[SCHEME_KEY] = ",".join(sorted({scheme.name for scheme, _ in state.quantized.values()}))
        for layout in LAYOUTS:
            mine = {name: mod for name, (scheme, mod) in state.quantized.items() if layout_of(scheme) is layout}
            metadata.update(layout.file_metadata(mine) if mine else {})
    return metadata


def _own_tensors(mod: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``mod``'s own parameters and persistent buffers, as its ``state_dict`` lists them."""
    for leaf, param in mod._parameters.items():
        if param is not None:
            yield leaf, param
    for leaf, buffer in mod._buffers.items():
        if buffer is not None and leaf not in mod._non_persistent_buffers_set:
            yield leaf, buffer


class _Latest:
    """The state of the quantized module last asked for, so that a module whose tensors its scheme makes for
    the file (bitsandbytes' CPU layout converted back) makes them about once per file, one module at a time."""

    def __init__(self) -> None:
        self._module: nn.Module | None = None
        self._state: dict[str, torch.Tensor] = {}

    def getter(self, module: nn.Module, scheme: QuantScheme, key: str) -> Callable[[], torch.Tensor]:
        """``module``'s tensor ``key``, from its state made once while the file's tensors of ``module`` are written."""

        def get() -> torch.Tensor:
            if self._module is not module:
                self._module, self._state = None, {}  # drop the previous module's before making this one's
                self._state, self._module = layout_of(scheme).state_dict_of(module), module
            return self._state[key]

        return get
