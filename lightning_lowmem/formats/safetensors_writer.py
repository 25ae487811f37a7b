"""Writing safetensors files one tensor at a time, sharded as ``save_pretrained`` shards them.

``safetensors.torch.save_file`` takes every tensor of a file at once. Where the tensors already
sit in CPU memory that costs nothing, but a tensor made for the file (a CUDA tensor's CPU copy,
a quantized weight converted back from bitsandbytes' CPU layout) would then be held with every
other one of its file until the file is written: a 5 GB shard of them. Here a file's header is
written from shapes and dtypes alone, then each tensor is asked for (:attr:`TensorToWrite.get`),
copied to CPU if it has to be, written, and dropped before the next.

The bytes are those ``save_file`` writes for the same tensors and metadata: tensors ordered by
dtype (widest first, so each one is aligned) then by name, a compact JSON header padded with
spaces to a multiple of 8 bytes (``save_file`` orders several metadata entries at random from run
to run; here they keep the order given). A set of several files is named as ``save_pretrained`` names
it (``model-00001-of-00003.safetensors``) with a ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3", torch.int16: "I16", torch.uint16: "U16", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int32: "I32", torch.uint32: "U32", torch.float32: "F32",
    torch.float64: "F64", torch.int64: "I64", torch.uint64: "U64",
}
_RANK = {dtype: i for i, dtype in enumerate(_DTYPE_NAMES)}  # safetensors' own dtype order: files list the last first
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


@dataclass(frozen=True)
class TensorToWrite:
    """One tensor of a file to write, known by its shape and dtype before it exists.

    Attributes:
        key: its name in the file.
        shape: its shape.
        dtype: its dtype.
        get: makes (or fetches) the tensor when it is written; it must have ``shape`` and ``dtype``.
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    get: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def of(cls, key: str, tensor: torch.Tensor) -> TensorToWrite:
        """A tensor that already exists."""
        return cls(key, tuple(tensor.shape), tensor.dtype, lambda: tensor)


def split_shards(tensors: Sequence[TensorToWrite], max_shard_size: int) -> list[list[TensorToWrite]]:
    """``tensors`` in order, cut into files of at most ``max_shard_size`` bytes as ``save_pretrained`` cuts them
    (``huggingface_hub.split_torch_state_dict_into_shards``): a file is closed when the next tensor would not
    fit, and a tensor larger than that gets a file of its own, placed before the file being filled.

    Example::

        >>> sizes = [TensorToWrite(k, (n,), torch.uint8, lambda: None) for k, n in zip("abcde", (3, 3, 9, 4, 1))]
        >>> [[t.key for t in shard] for shard in split_shards(sizes, 6)]
        [['c'], ['a', 'b'], ['d', 'e']]
    """
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be > 0 bytes, got {max_shard_size}.")
    shards: list[list[TensorToWrite]] = []
    current: list[TensorToWrite] = []
    size = 0
    for tensor in tensors:
        if tensor.nbytes > max_shard_size:
            shards.append([tensor])
            continue
        if current and size + tensor.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(tensor)
        size += tensor.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(n: int) -> list[str]:
    """The file names ``save_pretrained`` gives ``n`` files.

    Example::

        >>> shard_names(1), shard_names(2)
        (['model.safetensors'], ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors'])
    """
    return [SINGLE_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def write_safetensors(path: Path, tensors: Sequence[TensorToWrite], metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` to the safetensors file ``path``, one at a time; the file appears whole or not at all.

    Raises:
        ValueError: two tensors share a key, a dtype safetensors has no name for, or a tensor made by ``get``
            whose shape or dtype is not the one announced.
    """
    ordered = sorted(tensors, key=lambda t: (-_rank(t), t.key))
    header = _header(ordered, metadata)
    partial = path.with_name(f".{path.name}.partial")
    try:
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            for entry in ordered:
                _write_tensor(f, entry)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_sharded(directory: Path, tensors: Sequence[TensorToWrite], metadata: Mapping[str, str], max_shard_size: int,
                  index_metadata: Mapping[str, object] | None = None) -> list[Path]:
    """``tensors`` written into ``directory`` as ``save_pretrained`` lays a checkpoint out: ``model.safetensors``,
    or several files and ``model.safetensors.index.json`` (``metadata`` in every file). Files of an earlier
    save under these names that this one does not write are removed, so that no stale index or shard is
    left to be loaded. Returns the files written, the index last.
    """
    directory.mkdir(parents=True, exist_ok=True)
    shards = split_shards(tensors, max_shard_size)
    names = shard_names(len(shards))
    written = []
    for name, shard in zip(names, shards):
        write_safetensors(directory / name, shard, metadata)
        written.append(directory / name)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors), **(index_metadata or {})},
                 "weight_map": {t.key: name for name, shard in zip(names, shards) for t in shard}}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(directory / INDEX_FILE)
    _remove_stale(directory, {p.name for p in written})
    return written


def _remove_stale(directory: Path, keep: Iterable[str]) -> None:
    keep = set(keep)
    for path in directory.iterdir():
        stale = path.name == SINGLE_FILE or path.name == INDEX_FILE or _SHARD.fullmatch(path.name)
        if stale and path.name not in keep and path.is_file():
            path.unlink()


def _header(ordered: Sequence[TensorToWrite], metadata: Mapping[str, str] | None) -> bytes:
    """The JSON header for ``ordered`` (in that order in the data), padded with spaces to a multiple of 8 bytes."""
    header: dict[str, object] = {}
    if metadata:
        bad = {k: v for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)}
        if bad:
            raise ValueError(f"safetensors metadata must map str to str; got {list(bad.items())[:3]!r}.")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for entry in ordered:
        if entry.key in header:
            raise ValueError(f"Two tensors are named {entry.key!r}; a safetensors file holds each name once.")
        header[entry.key] = {"dtype": _DTYPE_NAMES[entry.dtype], "shape": list(entry.shape),
                             "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def _write_tensor(f, entry: TensorToWrite) -> None:
    tensor = entry.get()
    if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
        raise ValueError(f"Tensor {entry.key!r} was announced as {entry.dtype} {list(entry.shape)} but is "
                         f"{tensor.dtype} {list(tensor.shape)}; it changed while it was being saved.")
    data = tensor.detach().to("cpu").contiguous().reshape(-1)
    if data.numel():
        f.write(memoryview(data.view(torch.uint8).numpy()))


def _rank(entry: TensorToWrite) -> int:
    if entry.dtype not in _RANK:
        raise ValueError(f"Tensor {entry.key!r} is {entry.dtype}, which safetensors cannot store. "
                         f"Stored dtypes: {', '.join(str(d) for d in _DTYPE_NAMES)}.")
    return _RANK[entry.dtype]
