"""A safetensors header read through the file's own descriptor and checked as the ``safetensors`` package checks it.

The format (https://github.com/huggingface/safetensors): 8 bytes of little-endian header size ``N``, ``N``
bytes of UTF-8 JSON mapping each tensor's name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (and
an optional ``"__metadata__"`` of str -> str), then the data. The checks are safetensors' own: a header of at
most 100 MB starting with ``{``, every entry well formed, each tensor's bytes exactly ``numel x itemsize``,
the tensors' byte ranges following each other from the first byte of the data to its last, with no gap and
no overlap.

Reading it here rather than with ``safetensors.safe_open(path)`` has two reasons. The header and the data
then come through one descriptor, so a file renamed over the path between two opens cannot pair one file's
header with another's data. And the cost per tensor stays small: each entry becomes a compact tuple as
the JSON is parsed, where ``safe_open`` plus one ``get_slice`` per key took 0.9 s per 100,000 tensors.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lightning_lowmem.errors import CheckpointFormatError
from lightning_lowmem.formats.files import OpenedFile
from lightning_lowmem.formats.records import TensorRecord

MAX_HEADER_BYTES = 100_000_000
"""The largest header the ``safetensors`` package reads (its ``MAX_HEADER_SIZE``)."""

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_DAMAGED = ("The file is truncated or damaged (or still downloading): compare its size with the source and download it "
            "again.")


class _Entry(NamedTuple):
    """One tensor's header entry, as parsed (checked later, with its name)."""

    dtype: Any
    shape: Any
    begin: Any
    end: Any


class SafetensorsHeader(NamedTuple):
    """What a safetensors header says: each tensor's record and where its data starts in the file, and the metadata."""

    records: dict[str, TensorRecord]
    offsets: dict[str, int]
    metadata: dict[str, str]


def read_header(file: OpenedFile) -> SafetensorsHeader:
    """Read and check the header of the safetensors file ``file`` through its descriptor.

    Raises:
        CheckpointFormatError: anything the ``safetensors`` package would refuse, or a dtype lightning_lowmem
            cannot load; the message names the file and the tensor.
    """
    path = file.path
    if file.size < 8:
        raise CheckpointFormatError(f"{path} holds {file.size} bytes, fewer than a safetensors header's 8. {_DAMAGED}")
    (size,) = struct.unpack("<Q", file.pread(8, 0))
    if size > MAX_HEADER_BYTES or 8 + size > file.size:
        raise CheckpointFormatError(
            f"{path}: its header claims {size} bytes, but " + (f"safetensors reads at most {MAX_HEADER_BYTES}"
            if size > MAX_HEADER_BYTES else f"the file holds {file.size - 8} after the size field") + f". {_DAMAGED}")
    entries = _parse(file.pread(size, 8), path)
    metadata = _metadata(entries.pop("__metadata__", None), path)
    records, offsets = _records(entries, path, data_start=8 + size, data_size=file.size - 8 - size)
    return SafetensorsHeader(records, offsets, metadata)


def _parse(text: bytes, path: Path) -> dict[str, Any]:
    """The header's JSON: name -> :class:`_Entry` (or what stood there when it is not an entry).

    A name given twice keeps its last entry, as ``safetensors`` keeps it; the entry dropped leaves its bytes
    uncovered, which the check that the tensors tile the data then refuses (unless both are the same).
    """
    if text[:1] != b"{":
        raise CheckpointFormatError(f"{path}: its header does not start with '{{' (it starts {text[:16]!r}). "
                                    f"{_DAMAGED}")
    try:
        header = json.loads(text.decode("utf-8"), object_hook=_object)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointFormatError(f"{path}: its header is not valid UTF-8 JSON ({type(e).__name__}: "
                                    f"{str(e)[:200]}). {_DAMAGED}") from e
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: its header is not a JSON object of tensors. {_DAMAGED}")
    return header


def _object(entry: dict[str, Any]) -> Any:
    """A JSON object as it is parsed: a tensor's entry becomes a compact :class:`_Entry` at once (a million small
    dicts would cost ~0.5 GB); other fields in it are ignored, as safetensors ignores them."""
    if len(entry) >= 3 and "data_offsets" in entry and "dtype" in entry and "shape" in entry:
        offsets = entry["data_offsets"]
        if type(offsets) is list and len(offsets) == 2:
            return _Entry(entry["dtype"], entry["shape"], offsets[0], offsets[1])
    return entry


def _metadata(value: Any, path: Path) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise CheckpointFormatError(f"{path}: its header's '__metadata__' is not a mapping of text to text. {_DAMAGED}")
    return value


def _records(entries: dict[str, Any], path: Path, data_start: int,
             data_size: int) -> tuple[dict[str, TensorRecord], dict[str, int]]:
    """Each entry checked and made a record; the byte ranges checked to tile the data exactly."""
    records: dict[str, TensorRecord] = {}
    ranges: list[tuple[int, int, str]] = []
    for name, entry in entries.items():
        dtype, shape = _checked(name, entry, path)
        records[name] = TensorRecord(name, shape, dtype, path)
        ranges.append((entry.begin, entry.end, name))
    ranges.sort()
    end = 0
    for begin, stop, name in ranges:
        if begin != end:
            raise CheckpointFormatError(
                f"{path}: tensor {name!r} starts at byte {begin} of the data, where the tensor before it ends at "
                f"{end}: the tensors' bytes must follow each other with no gap or overlap. {_DAMAGED}")
        end = stop
    if end != data_size:
        raise CheckpointFormatError(f"{path}: its tensors take {end} bytes, but the file holds {data_size} after the "
                                    f"header. {_DAMAGED}")
    return records, {name: data_start + begin for begin, _, name in ranges}


def _checked(name: str, entry: Any, path: Path) -> tuple[torch.dtype, tuple[int, ...]]:
    """The dtype and shape of a well-formed entry whose byte range is exactly its tensor's size."""
    if type(entry) is not _Entry:
        raise CheckpointFormatError(f"{path}: the header's entry for {name!r} is not {{'dtype', 'shape', "
                                    f"'data_offsets': [begin, end]}} ({str(entry)[:100]}). {_DAMAGED}")
    dtype = DTYPES.get(entry.dtype) if type(entry.dtype) is str else None
    if dtype is None:
        raise CheckpointFormatError(
            f"{path}: tensor {name!r} has dtype {str(entry.dtype)[:40]}, which lightning_lowmem cannot load. "
            f"Supported: {', '.join(DTYPES)}.")
    shape, begin, end = entry.shape, entry.begin, entry.end
    if not (type(shape) is list and type(begin) is int and type(end) is int and 0 <= begin <= end < 2**63
            and all(type(n) is int and 0 <= n < 2**63 for n in shape)):
        raise CheckpointFormatError(f"{path}: tensor {name!r} has shape {str(shape)[:100]} and data offsets "
                                    f"[{begin}, {end}]: they must be non-negative integers. {_DAMAGED}")
    numel = math.prod(shape)
    if end - begin != numel * dtype.itemsize:
        raise CheckpointFormatError(
            f"{path}: tensor {name!r} ({shape} x {entry.dtype}) needs {numel * dtype.itemsize} bytes, but its "
            f"data offsets [{begin}, {end}] hold {end - begin}. {_DAMAGED}")
    return dtype, tuple(shape)
