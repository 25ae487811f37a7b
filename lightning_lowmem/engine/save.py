"""``save_checkpoint``: what a module holds, full precision or quantized, as safetensors in transformers' layout.

::

    walk the module: a quantized module -> its scheme's tensors (``QuantScheme.state_dict_of``)
                     any other module   -> its own parameters and persistent buffers (tied ones once)
    -> shapes and dtypes first: the files' headers, cut into shards of ``max_shard_size``
    -> each tensor asked for, copied to CPU if it has to be, written, dropped; the next

The files load back with :func:`~lightning_lowmem.load_checkpoint` as they are, nothing quantized again, and
with transformers' ``from_pretrained`` where transformers reads the scheme (a transformers model also gets its
``config.json``, with the ``quantization_config`` transformers needs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lightning_lowmem.dtypes import model_dtype
from lightning_lowmem.errors import MetaTensorError, UnsupportedQuantizationError, format_names
from lightning_lowmem.formats.safetensors_writer import TensorToWrite, write_sharded
from lightning_lowmem.memory.units import parse_bytes
from lightning_lowmem.meta import fabric_unwrapped
from lightning_lowmem.placement import architecture_of
from lightning_lowmem.quantize import QuantScheme
from lightning_lowmem.quantize.schemes import library_classes
from lightning_lowmem.quantize.selection import as_linear
from lightning_lowmem.quantize.stored import scheme_of

SCHEME_KEY = "lightning_lowmem.quantize"
"""The metadata key naming the scheme(s) of a saved checkpoint's quantized weights."""


@dataclass
class ModuleState:
    """What :func:`save_checkpoint` writes of a module, known before anything is written.

    Attributes:
        tensors: every tensor to write, in module order (each made when it is written).
        metadata: the text every file carries (``format``, the scheme, what the scheme's library needs).
        quantized: quantized module name -> (its scheme, the module).
        full_precision: the ``nn.Linear`` (and transformers ``Conv1D``) modules kept in full precision.
    """

    tensors: list[TensorToWrite] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    quantized: dict[str, tuple[QuantScheme, nn.Module]] = field(default_factory=dict)
    full_precision: list[str] = field(default_factory=list)

    def materialized(self) -> dict[str, torch.Tensor]:
        """Every tensor, made now (for a single torch file; a safetensors file is written one tensor at a time)."""
        return {t.key: t.get() for t in self.tensors}


def save_checkpoint(module: nn.Module, path: str | Path, *, max_shard_size: int | str = "5GB") -> list[Path]:
    """Write what ``module`` holds, quantized or not, into the directory ``path`` as safetensors.

    Quantized layers are written as their library stores them, in the layout transformers saves for the same
    library (bitsandbytes: packed weight, ``absmax``, ``quant_map``, the quant state's JSON; torchao: the
    inner tensors and the metadata of torchao's safetensors flattening). One tensor is made and written at a
    time: the peak is the model plus about one tensor. Every file's metadata has ``format: pt`` and, for a
    quantized model, ``lightning_lowmem.quantize`` (the scheme). A transformers model also gets its
    ``config.json`` (with its ``quantization_config``), a litgpt ``GPT`` its ``model_config.yaml``.

    Args:
        module: the module to save (or what ``fabric.setup`` made of it); nothing of it may be on the meta
            device.
        path: a directory (made if missing). Files of an earlier save there under the names this one uses
            (``model.safetensors``, ``model-0000i-of-0000n.safetensors``, the index) are replaced or removed.
        max_shard_size: bytes per file (an int, or ``"5GB"``, ``"500MiB"``); past it the tensors are split
            over several files named as ``save_pretrained`` names them, with ``model.safetensors.index.json``.

    Returns:
        The files written (the index last, when there is one).

    Raises:
        MetaTensorError: tensors of ``module`` are still on meta.

    Example::

        >>> import tempfile
        >>> directory = tempfile.mkdtemp()
        >>> [p.name for p in save_checkpoint(nn.Linear(4, 2), directory)]
        ['model.safetensors']
    """
    directory = Path(path)
    if directory.suffix in (".safetensors", ".json") or directory.is_file():
        raise ValueError(f"save_checkpoint writes a directory (as save_pretrained does); {str(path)!r} names a "
                         "file. Pass the directory to write model.safetensors into.")
    module = fabric_unwrapped(module)
    state = module_state(module)
    written = write_sharded(directory, state.tensors, state.metadata, parse_bytes(max_shard_size))
    architecture_of(module).save_config(module, directory, transformers_config(module, state))
    return written


def module_state(module: nn.Module) -> ModuleState:
    """What :func:`save_checkpoint` writes of ``module``: its tensors (made when written) and metadata.

    Raises:
        MetaTensorError: tensors of ``module`` are still on meta.
    """
    module = fabric_unwrapped(module)  # its names, not the wrapper's
    _refuse_parametrized(module)
    state, seen, on_meta = ModuleState(), set(), []
    cache = _Latest()
    for name, mod in module.named_modules():
        prefix = f"{name}." if name else ""
        scheme = scheme_of(mod)
        if scheme is not None:
            state.quantized[name] = (scheme, mod)
            for key, tensor in scheme.state_dict_of(mod).items():  # shapes now; the tensors again when written
                state.tensors.append(TensorToWrite(prefix + key, tuple(tensor.shape), tensor.dtype,
                                                   cache.getter(mod, scheme, key)))
            seen.update(id(t) for t in mod.parameters(recurse=False))
            continue
        if as_linear(mod)[0] is not None:  # an nn.Linear (or transformers' Conv1D) kept in full precision
            state.full_precision.append(name)
        for leaf, tensor in _own_tensors(mod):
            if id(tensor) in seen:
                continue  # tied: saved once, under its first name
            seen.add(id(tensor))
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


def transformers_config(module: nn.Module, state: ModuleState) -> dict | None:
    """The ``quantization_config`` transformers reads ``state``'s quantized weights with; None when the module is
    not quantized, mixes schemes, or transformers cannot read its scheme."""
    schemes = {scheme.name: (scheme, mod) for scheme, mod in state.quantized.values()}
    if len(schemes) != 1:
        return None
    scheme, mod = next(iter(schemes.values()))
    compute = getattr(mod, "compute_dtype", None)
    compute = compute if isinstance(compute, torch.dtype) else model_dtype(module)
    return scheme.transformers_config(state.full_precision, compute)


def _metadata(state: ModuleState) -> dict[str, str]:
    metadata = {"format": "pt"}
    if state.quantized:
        metadata[SCHEME_KEY] = ",".join(sorted({scheme.name for scheme, _ in state.quantized.values()}))
        for cls in library_classes("file_metadata"):
            metadata.update(cls.file_metadata(state.quantized))
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
                self._state, self._module = scheme.state_dict_of(module), module
            return self._state[key]

        return get
