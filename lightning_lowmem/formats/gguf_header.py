"""A GGUF file's header, parsed in one bounded walk: every count, length and offset checked against the file.

The ``gguf`` package's ``GGUFReader`` (the format's reference reader) was measured unfit for
this (gguf 0.19, numpy 2.4, this 2-core machine):

* it trusts the counts it reads: a 100-byte file declaring an array of 10**6 elements kept it
  busy 15 s and took 0.9 GiB; 10**8 elements ran it out of memory;
* it builds a chain of numpy views per array element, about 710 bytes and 11 us each (1.4 KB
  and 23 us per string): a Llama-3-sized vocabulary (128k tokens, 128k token types, 280k merges)
  took 13.7 s and 613 MiB to parse, before any weight is read. This walk took 0.9 s and 4 MiB;
* it memory-maps the whole file (``numpy.memmap``; only the header's pages are touched).

So the header is read here, in 1 MiB blocks through the file's own descriptor:

* magic ``GGUF``, version 2 or 3, little-endian (a big-endian file is refused by name);
* every string and array fits in the bytes left, arrays nest at most two deep and hold at most
  :data:`MAX_ARRAY_ELEMENTS` elements in all; scalar fields are decoded, arrays (the vocabulary)
  are skipped and left in the file for a tokenizer to parse;
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

GGUF_MAGIC = b"GGUF"
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_ELEMENTS = 1 << 23
"""Array elements of all metadata together (8 Mi). A real header holds about three per vocabulary entry (tokens,
scores, token types) plus merges: a 256k vocabulary with its merges needs about 1 Mi. A tokenizer that parses
them later (transformers' GGUF parser, through ``GGUFReader``) spends about 1 KB per element."""
_BLOCK = 1 << 20
_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SCALARS = {vtype: struct.calcsize("<" + fmt) for vtype, fmt in _FORMATS.items()}  # GGUFValueType -> bytes
_STRING, _ARRAY = 8, 9
_TOO_DEEP = 2


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
        arrays: every array field: its element type (``GGUFValueType``) and length.
    """

    version: int
    alignment: int = 32
    data_start: int = 0
    tensors: list[TensorInfo] = field(default_factory=list)
    metadata: dict[str, int | float | bool | str] = field(default_factory=dict)
    arrays: dict[str, tuple[int, int]] = field(default_factory=dict)

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


class _Cursor:
    """Reads a file forward, a block at a time, never past its end."""

    def __init__(self, file: OpenedFile) -> None:
        self.file, self.pos, self._buffer, self._start = file, 0, b"", 0

    def left(self) -> int:
        return self.file.size - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.left():
            raise _short(self.file, self.pos, n, what)
        end = self.pos + n
        if not (self._start <= self.pos and end <= self._start + len(self._buffer)):
            self._start = self.pos
            self._buffer = self.file.pread(max(n, _BLOCK), self.pos)
        out = self._buffer[self.pos - self._start:end - self._start]
        self.pos = end
        return out

    def skip(self, n: int, what: str) -> None:
        if n > self.left():
            raise _short(self.file, self.pos, n, what)
        self.pos += n

    def unpack(self, fmt: str, what: str) -> int | float:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> bytes:
        return self.take(int(self.unpack("Q", f"the length of {what}")), what)


def _short(file: OpenedFile, pos: int, n: int, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{file.path}: its GGUF header needs {n} bytes for {what} at byte {pos}, but the file ends at byte "
        f"{file.size}. The file is truncated or damaged: download or convert it again.")


def _damaged(file: OpenedFile, message: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{file.path}: {message}. The GGUF file is damaged or not one lightning_lowmem can "
                                 "read: download or convert it again.")


def walk_header(file: OpenedFile) -> HeaderLayout:
    """Check ``file``'s GGUF header from its bytes alone (see the module's docstring); the layout it declares.

    Raises:
        CheckpointFormatError: naming the file, the field or tensor, the values seen and what to do.
    """
    cur = _Cursor(file)
    if cur.take(4, "the magic") != GGUF_MAGIC:
        raise _damaged(file, "it does not start with the GGUF magic")
    raw = cur.take(4, "the version")
    version = struct.unpack("<I", raw)[0]
    if version & 0xFFFF == 0 and struct.unpack(">I", raw)[0] in (2, 3):
        raise CheckpointFormatError(f"{file.path} is a big-endian GGUF file, which lightning_lowmem does not read. "
                                    "Convert it to little-endian (gguf's gguf_convert_endian script).")
    if version not in (2, 3):
        raise _damaged(file, f"GGUF version {version}; versions 2 and 3 are read")
    n_tensors, n_fields = cur.unpack("Q", "the tensor count"), cur.unpack("Q", "the metadata count")
    layout = HeaderLayout(version=version)
    _walk_fields(cur, int(n_fields), layout)
    infos = [_tensor_info(cur, i) for i in range(int(n_tensors))]
    layout.data_start = cur.pos + (-cur.pos) % layout.alignment
    names: set[str] = set()
    for info in infos:
        if info[0] in names:
            raise _damaged(file, f"tensor {info[0]!r} appears twice")
        names.add(info[0])
        layout.tensors.append(_checked(file, layout, *info))
    _check_data_end(file, layout)
    return layout


def _walk_fields(cur: _Cursor, count: int, layout: HeaderLayout) -> None:
    budget = [MAX_ARRAY_ELEMENTS]
    for _ in range(count):
        raw = cur.string("a metadata key")
        key = raw.decode("utf-8", errors="replace")
        if key in layout.metadata or key in layout.arrays:
            raise _damaged(cur.file, f"metadata key {key!r} appears twice")
        vtype = int(cur.unpack("I", f"the type of {key!r}"))
        if vtype in _FORMATS:
            layout.metadata[key] = cur.unpack(_FORMATS[vtype], f"the value of {key!r}")
        elif vtype == _STRING:
            layout.metadata[key] = cur.string(f"the string {key!r}").decode("utf-8", errors="replace")
        else:
            start = cur.pos
            _walk_value(cur, vtype, key, budget, depth=0)
            layout.arrays[key] = struct.unpack("<IQ", cur.file.pread(12, start))
        if key == "general.alignment":
            layout.alignment = _alignment(cur, vtype, layout.metadata.get(key))


def _walk_value(cur: _Cursor, vtype: int, key: str, budget: list[int], depth: int) -> None:
    if vtype in _SCALARS:
        cur.skip(_SCALARS[vtype], f"the value of {key!r}")
    elif vtype == _STRING:
        cur.skip(int(cur.unpack("Q", f"the length of {key!r}")), f"the string {key!r}")
    elif vtype == _ARRAY and depth < _TOO_DEEP:
        itype, count = int(cur.unpack("I", f"the type of {key!r}")), int(cur.unpack("Q", f"the length of {key!r}"))
        if itype not in _SCALARS and itype not in (_STRING, _ARRAY):
            raise _damaged(cur.file, f"metadata {key!r} is an array of type {itype}, which GGUF does not define")
        smallest = _SCALARS.get(itype, 8 if itype == _STRING else 12)  # a string or an array: its lengths at least
        budget[0] -= count
        if count * smallest > cur.left() or budget[0] < 0:
            raise _damaged(cur.file, f"metadata {key!r} declares {count} elements of type {itype}, more than its "
                                     f"{cur.left()} bytes left hold or than {MAX_ARRAY_ELEMENTS} in all")
        if itype in _SCALARS:
            cur.skip(count * _SCALARS[itype], f"the array {key!r}")
            return
        for _ in range(count):
            _walk_value(cur, itype, key, budget, depth + 1)
    else:
        raise _damaged(cur.file, f"metadata {key!r} has value type {vtype}, which GGUF does not define"
                       + (" (arrays nested too deep)" if vtype == _ARRAY else ""))


def _alignment(cur: _Cursor, vtype: int, value: object) -> int:
    if vtype != 4 or not isinstance(value, int) or value == 0 or value & (value - 1):
        raise _damaged(cur.file, f"general.alignment must be a power of two stored as uint32 (type 4), got type "
                                 f"{vtype}, value {value}")
    return value


def _tensor_info(cur: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    raw = cur.string(f"the name of tensor {index}")
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _damaged(cur.file, f"tensor {index}'s name {raw[:80]!r} is not UTF-8") from e
    n_dims = int(cur.unpack("I", f"the dimension count of {name!r}"))
    if n_dims > MAX_DIMS:
        raise _damaged(cur.file, f"tensor {name!r} has {n_dims} dimensions, more than GGUF's {MAX_DIMS}")
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
        raise _damaged(file, f"tensor {name!r} ({qtype.name}, dims {list(dims)}): rows of {dims[0]} elements are not "
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
        raise _damaged(file, f"its tensors' data ends at byte {end} but the file holds {file.size} bytes "
                             f"(alignment {layout.alignment})")
