"""A GGUF file's header, parsed in one bounded walk: every count, length and offset checked against the file.

The ``gguf`` package's ``GGUFReader`` (the format's reference reader) was measured unfit for
this (gguf 0.19, numpy 2.4, this 2-core machine):

* it trusts the counts it reads: a 100-byte file declaring an array of 10**6 elements kept it
  busy 15 s and took 0.9 GiB; 10**8 elements ran it out of memory;
* it builds a chain of numpy views per array element, about 710 bytes and 11 us each (1.4 KB
  and 23 us per string): a Llama-3-sized vocabulary (128k tokens, 128k token types, 280k merges)
  took 13.7 s and 613 MiB to parse, before any weight is read;
* it memory-maps the whole file (``numpy.memmap``): a file cut short by another process while it
  is parsed kills the parsing process with SIGBUS.

So the header is read here, in 1 MiB blocks through the file's own descriptor:

* magic ``GGUF``, version 2 or 3, little-endian (a big-endian file is refused by name);
* the metadata (``gguf_metadata.py``): scalar fields decoded, arrays (the vocabulary) kept compact,
  every string and array within the bytes left, arrays nested at most two deep, everything kept
  within a total bound;
* every tensor: a name seen once, at most 4 dimensions, a type the ``gguf`` package knows
  (``GGMLQuantizationType``, ``GGML_QUANT_SIZES``), rows a whole number of its blocks, and its data
  right after the previous tensor's (padded to the alignment), as ggml's own reader requires; the
  data ends where the file ends (give or take the last tensor's padding).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

from lightning_lowmem.errors import CheckpointFormatError
from lightning_lowmem.formats.files import OpenedFile
from lightning_lowmem.formats.gguf_metadata import Budget, HeaderCursor, MetadataArray, damaged, read_value

GGUF_MAGIC = b"GGUF"
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ENTRIES = 1 << 16
"""Tensors, and metadata fields, a header may declare (each costs about 1 KB of Python objects). Real files hold
a few hundred to a few thousand tensors (DeepSeek-V3: about 1,000 per file) and a few dozen fields."""
_UINT32 = 4  # GGUFValueType.UINT32, the type general.alignment must have


@dataclass
class TensorInfo:
    """One tensor as the header declares it.

    Attributes:
        name: its name.
        dims: its dimensions in ggml's order (``ne[0]``, the contiguous one, first).
        type_name: its ggml type (``"F16"``, ``"Q4_0"``, ...).
        offset: where its data starts in the file (absolute).
        nbytes: the bytes it stores.
    """

    name: str
    dims: tuple[int, ...]
    type_name: str
    offset: int
    nbytes: int


@dataclass
class HeaderLayout:
    """What the header declares.

    Attributes:
        version: the GGUF version (2 or 3).
        alignment: the tensors' data alignment (``general.alignment``, default 32).
        data_start: where the tensor data starts.
        tensors: every tensor, in the header's order.
        metadata: every scalar field (numbers, bools, strings), decoded.
        arrays: every array field, kept compact (:class:`~lightning_lowmem.formats.gguf_metadata.MetadataArray`).
    """

    version: int
    alignment: int = 32
    data_start: int = 0
    tensors: list[TensorInfo] = field(default_factory=list)
    metadata: dict[str, int | float | bool | str] = field(default_factory=dict)
    arrays: dict[str, MetadataArray] = field(default_factory=dict)

    @property
    def split_count(self) -> int:
        """How many files the model is split into (``split.count``; 1 when not split)."""
        count = self.metadata.get("split.count", 1)
        return count if isinstance(count, int) and not isinstance(count, bool) else 1


def import_gguf() -> Any:
    """The ``gguf`` package, or an ImportError saying how to install it."""
    try:
        import gguf
    except ImportError as e:
        raise ImportError("Reading .gguf files needs the gguf package (llama.cpp's Python library): "
                          "pip install gguf") from e
    return gguf


def walk_header(file: OpenedFile) -> HeaderLayout:
    """Check ``file``'s GGUF header from its bytes alone (see the module's docstring); the layout it declares.

    Raises:
        CheckpointFormatError: naming the file, the field or tensor, the values seen and what to do.
    """
    cur = HeaderCursor(file)
    if cur.take(4, "the magic") != GGUF_MAGIC:
        raise damaged(file, "it does not start with the GGUF magic")
    raw = cur.take(4, "the version")
    version = struct.unpack("<I", raw)[0]
    if version & 0xFFFF == 0 and struct.unpack(">I", raw)[0] in (2, 3):
        raise CheckpointFormatError(f"{file.path} is a big-endian GGUF file, which lightning_lowmem does not read. "
                                    "Convert it to little-endian (gguf's gguf_convert_endian script).")
    if version not in (2, 3):
        raise damaged(file, f"GGUF version {version}; versions 2 and 3 are read")
    n_tensors, n_fields = int(cur.unpack("Q", "the tensor count")), int(cur.unpack("Q", "the metadata count"))
    for count, what in ((n_tensors, "tensors"), (n_fields, "metadata fields")):
        if count > MAX_ENTRIES:
            raise damaged(file, f"its header declares {count} {what}, more than the {MAX_ENTRIES} read")
    layout = HeaderLayout(version=version)
    _walk_fields(cur, n_fields, layout)
    infos = [_tensor_info(cur, i) for i in range(n_tensors)]
    layout.data_start = cur.pos + (-cur.pos) % layout.alignment
    names: set[str] = set()
    for info in infos:
        if info[0] in names:
            raise damaged(file, f"tensor {info[0]!r} appears twice")
        names.add(info[0])
        layout.tensors.append(_checked(file, layout, *info))
    _check_data_end(file, layout)
    return layout


def _walk_fields(cur: HeaderCursor, count: int, layout: HeaderLayout) -> None:
    budget = Budget(cur.file)
    for _ in range(count):
        raw = cur.string("a metadata key")
        key = raw.decode("utf-8", errors="replace")
        if key in layout.metadata or key in layout.arrays:
            raise damaged(cur.file, f"metadata key {key!r} appears twice")
        vtype = int(cur.unpack("I", f"the type of {key!r}"))
        value = read_value(cur, vtype, key, budget)
        if isinstance(value, MetadataArray):
            layout.arrays[key] = value
        else:
            layout.metadata[key] = value
        if key == "general.alignment":
            layout.alignment = _alignment(cur, vtype, value)


def _alignment(cur: HeaderCursor, vtype: int, value: object) -> int:
    if vtype != _UINT32 or not isinstance(value, int) or value == 0 or value & (value - 1):
        raise damaged(cur.file, f"general.alignment must be a power of two stored as uint32 (type 4), got type "
                                 f"{vtype}, value {value}")
    return value


def _tensor_info(cur: HeaderCursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    raw = cur.string(f"the name of tensor {index}")
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise damaged(cur.file, f"tensor {index}'s name {raw[:80]!r} is not UTF-8") from e
    n_dims = int(cur.unpack("I", f"the dimension count of {name!r}"))
    if n_dims > MAX_DIMS:
        raise damaged(cur.file, f"tensor {name!r} has {n_dims} dimensions, more than GGUF's {MAX_DIMS}")
    dims = tuple(int(cur.unpack("Q", f"the dimensions of {name!r}")) for _ in range(n_dims))
    return name, dims, int(cur.unpack("I", f"the type of {name!r}")), int(cur.unpack("Q", f"the offset of {name!r}"))


def _checked(file: OpenedFile, layout: HeaderLayout, name: str, dims: tuple[int, ...], type_id: int,
             offset: int) -> TensorInfo:
    """The tensor's info, once its type, rows and data range are known to be sound."""
    gguf = import_gguf()
    try:
        qtype = gguf.GGMLQuantizationType(type_id)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError) as e:
        raise CheckpointFormatError(
            f"{file.path}: tensor {name!r} is stored in ggml type {type_id}, which the installed gguf package "
            "does not know. Upgrade gguf (pip install -U gguf), or convert the file to a known type.") from e
    if dims and dims[0] % block:
        raise damaged(file, f"tensor {name!r} ({qtype.name}, dims {list(dims)}): rows of {dims[0]} elements are not "
                             f"a whole number of {qtype.name}'s {block}-element blocks")
    nbytes = math.prod(dims) // block * type_size
    start = layout.data_start + offset
    expected = _padded_end(layout)
    if start + nbytes > file.size or start != expected:
        where = "lies past the end of the file" if start + nbytes > file.size else \
            f"does not follow the previous tensor's data (expected offset {expected - layout.data_start})"
        raise CheckpointFormatError(
            f"{file.path}: tensor {name!r} ({qtype.name}, {nbytes} bytes at offset {offset}, bytes {start}.."
            f"{start + nbytes}) {where} (file size {file.size}, alignment {layout.alignment}). The file is "
            "truncated or damaged: download or convert it again.")
    return TensorInfo(name, dims, qtype.name, start, nbytes)


def _padded_end(layout: HeaderLayout) -> int:
    """Where the next tensor's data starts: after the last one's, padded to the alignment."""
    if not layout.tensors:
        return layout.data_start
    last = layout.tensors[-1]
    end = last.offset + last.nbytes
    return end + (-end) % layout.alignment


def _check_data_end(file: OpenedFile, layout: HeaderLayout) -> None:
    """The tensors' data must end where the file ends, give or take the last tensor's padding."""
    end = layout.tensors[-1].offset + layout.tensors[-1].nbytes if layout.tensors else layout.data_start
    if not end <= file.size <= _padded_end(layout):
        raise damaged(file, f"its tensors' data ends at byte {end} but the file holds {file.size} bytes "
                             f"(alignment {layout.alignment})")
