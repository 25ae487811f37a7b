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

Files are written into a directory that holds none of them yet (the new directory of a save, switched in
whole by :mod:`~lightning_lowmem.saving.atomic_directory`): each is created with ``O_EXCL | O_NOFOLLOW``,
so nothing is ever written through a link, then flushed and fsynced.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_lowmem.saving.atomic_file import write_new

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3", torch.int16: "I16", torch.uint16: "U16", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int32: "I32", torch.uint32: "U32", torch.float32: "F32",
    torch.float64: "F64", torch.int64: "I64", torch.uint64: "U64",
}
_RANK = {dtype: i for i, dtype in enumerate(_DTYPE_NAMES)}  # safetensors' own dtype order: files list the last first
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
WRITER_KEY = "lightning_lowmem.writer"
"""The metadata key (in every file's header and in the index) that marks a save of this library: a later save
replaces such files, and refuses to sit beside weight files without it (unless told to remove them)."""
WRITER = "lightning_lowmem"
SCHEME_KEY = "lightning_lowmem.quantize"
"""The metadata key naming the scheme(s) of a saved checkpoint's quantized weights."""


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


@dataclass(frozen=True)
class PlannedFile:
    """One safetensors file of a save, known before it is written.

    Attributes:
        name: its file name.
        tensors: its tensors, in the order of its data (dtype widest first, then name).
        header: its JSON header, padded.
    """

    name: str
    tensors: list[TensorToWrite]
    header: bytes

    @property
    def nbytes(self) -> int:
        """The file's size."""
        return 8 + len(self.header) + sum(t.nbytes for t in self.tensors)

    @classmethod
    def of(cls, name: str, tensors: Sequence[TensorToWrite], metadata: Mapping[str, str] | None) -> PlannedFile:
        """``tensors`` as one file named ``name``.

        Raises:
            ValueError: two tensors share a key, or a dtype safetensors has no name for.
        """
        ordered = sorted(tensors, key=lambda t: (-_rank(t), t.key))
        return cls(name, ordered, _header(ordered, metadata))


@dataclass(frozen=True)
class ShardedPlan:
    """The files of a save, known before any is written: ``files``, and ``index`` (the index's bytes) when there
    are several."""

    files: list[PlannedFile]
    index: bytes | None

    @property
    def sizes(self) -> list[int]:
        """Bytes of each file to write, the index last."""
        return [f.nbytes for f in self.files] + ([len(self.index)] if self.index is not None else [])


def plan_sharded(tensors: Sequence[TensorToWrite], metadata: Mapping[str, str], max_shard_size: int,
                 index_metadata: Mapping[str, object] | None = None) -> ShardedPlan:
    """``tensors`` as ``save_pretrained`` lays a checkpoint out: ``model.safetensors``, or several files and the
    index ``model.safetensors.index.json`` (``metadata`` in every file; ``index_metadata`` and the writer key in
    the index's ``metadata``)."""
    shards = split_shards(tensors, max_shard_size)
    files = [PlannedFile.of(name, shard, metadata) for name, shard in zip(shard_names(len(shards)), shards)]
    if len(files) == 1:
        return ShardedPlan(files, None)
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors), WRITER_KEY: WRITER, **(index_metadata or {})},
             "weight_map": {t.key: f.name for f in files for t in f.tensors}}
    return ShardedPlan(files, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())


def write_safetensors(path: Path, tensors: Sequence[TensorToWrite], metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` to the new safetensors file ``path``, one at a time (nothing may be at ``path``: a link
    is never followed); a failed write leaves no file.

    Raises:
        ValueError: two tensors share a key, a dtype safetensors has no name for, or a tensor made by ``get``
            whose shape or dtype is not the one announced.
        FileExistsError: something is at ``path``.
    """
    _write_file(path, PlannedFile.of(path.name, tensors, metadata))


def write_sharded(directory: Path, plan: ShardedPlan) -> list[Path]:
    """The files of ``plan`` (:func:`plan_sharded`) written into ``directory``, which holds none of them yet, the
    index last. Returns the files written, the index last."""
    written = []
    for planned in plan.files:
        _write_file(directory / planned.name, planned)
        written.append(directory / planned.name)
    if plan.index is not None:
        with write_new(directory / INDEX_FILE) as f:
            f.write(plan.index)
        written.append(directory / INDEX_FILE)
    return written


def _write_file(path: Path, planned: PlannedFile) -> None:
    with write_new(path) as f:
        f.write(struct.pack("<Q", len(planned.header)) + planned.header)
        for entry in planned.tensors:
            _write_tensor(f, entry)


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
