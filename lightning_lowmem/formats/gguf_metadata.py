"""A GGUF header's metadata, read in one bounded pass: scalars decoded, arrays kept compact.

A header's arrays are mostly the vocabulary: tokens, scores, token types and merges, about four
entries per token (a 128k vocabulary with its merges: half a million). Each array is kept as it
was read, never as one Python object per element:

* numbers: one numpy array (little-endian, the element type of the file);
* strings: the bytes of the array as stored (each string after its 8-byte length) and where each
  string starts, so a token costs its own bytes + 16;
* arrays of arrays: not decoded (GGUF allows them; no model's header has one).

Everything the walk keeps is bounded twice: by the bytes the file holds (every count and length is
checked against the bytes left before anything is allocated for it), and in total by
:data:`MAX_ARRAY_ELEMENTS` elements and :data:`MAX_METADATA_BYTES` bytes. Decoding an array to
Python values (:meth:`MetadataArray.tolist`) is left to whoever needs them (a tokenizer).

The file is read forward through its own descriptor (:class:`HeaderCursor`, 1 MiB blocks); a file
cut short while it is read is a :class:`~lightning_lowmem.CheckpointFormatError`, never a signal.
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lightning_lowmem.errors import CheckpointFormatError

if TYPE_CHECKING:
    from lightning_lowmem.formats.files import OpenedFile

MAX_ARRAY_ELEMENTS = 1 << 23
"""Array elements of all metadata together (8 Mi). A real header holds about three per vocabulary entry (tokens,
scores, token types) plus merges: a 256k vocabulary with its merges needs about 1 Mi."""
MAX_METADATA_BYTES = 256 * 2**20
"""Bytes of metadata kept (strings, arrays and their offsets). A 256k vocabulary with its merges takes about
12 MiB; Llama 3's (128k tokens, 280k merges) 9 MiB."""
BLOCK = 1 << 20
FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
"""GGUFValueType -> struct format of the scalar types."""
SCALAR_BYTES = {vtype: struct.calcsize("<" + fmt) for vtype, fmt in FORMATS.items()}
STRING, ARRAY = 8, 9
_NUMPY = {vtype: np.dtype("<" + fmt) for vtype, fmt in FORMATS.items()}
_TOO_DEEP = 2
_STRING_COST = 16  # bytes kept per string of an array beyond its own: its length as stored and its offset


@dataclass(frozen=True)
class MetadataArray:
    """An array field of a GGUF header, kept as it was read.

    Attributes:
        item_type: the elements' ``GGUFValueType`` (``8``: strings, ``9``: arrays, not decoded).
        length: how many elements.
        values: the numbers, for a numeric array.
        data: for strings, the array's bytes as stored (each string after its 8-byte length).
        starts: for strings, where each string's bytes start in ``data``.

    Example::

        >>> a = MetadataArray(8, 2, data=b"\\x02\\0\\0\\0\\0\\0\\0\\0hi\\x01\\0\\0\\0\\0\\0\\0\\0!", starts=np.array([8, 18]))
        >>> len(a), a.tolist(), a.string(1)
        (2, ['hi', '!'], '!')
    """

    item_type: int
    length: int
    values: np.ndarray | None = None
    data: bytes = b""
    starts: np.ndarray | None = None

    def __len__(self) -> int:
        return self.length

    def string(self, index: int) -> str:
        """String ``index`` of a string array (UTF-8; bytes that are not are replaced)."""
        start = int(self.starts[index])
        end = int(self.starts[index + 1]) - 8 if index + 1 < self.length else len(self.data)
        return self.data[start:end].decode("utf-8", errors="replace")

    def tolist(self) -> list:
        """The elements as Python values (``int``, ``float``, ``bool``, ``str``), as transformers' GGUF parser gives
        them.

        Raises:
            ValueError: an array of arrays (not decoded).
        """
        if self.values is not None:
            return self.values.tolist()
        if self.item_type != STRING:
            raise ValueError("an array of arrays is not decoded")
        if not self.length:
            return []
        ends = (self.starts[1:] - 8).tolist() + [len(self.data)]
        data = self.data
        return [data[s:e].decode("utf-8", errors="replace") for s, e in zip(self.starts.tolist(), ends, strict=True)]

    @property
    def nbytes(self) -> int:
        """Bytes this array keeps."""
        return len(self.data) + sum(a.nbytes for a in (self.values, self.starts) if a is not None)


class HeaderCursor:
    """Reads a file forward, a block at a time, never past its end; a file that shrinks while it is read is a
    :class:`CheckpointFormatError`."""

    def __init__(self, file: OpenedFile) -> None:
        self.file, self.pos, self.buffer, self.start = file, 0, b"", 0

    def left(self) -> int:
        return self.file.size - self.pos

    def fill(self, n: int, what: str) -> int:
        """Make the buffer hold bytes ``pos .. pos + n``; where ``pos`` is in it."""
        if n > self.left():
            raise short_header(self.file, self.pos, n, what)
        if not (self.start <= self.pos and self.pos + n <= self.start + len(self.buffer)):
            self.start, self.buffer = self.pos, self.file.pread(max(n, BLOCK), self.pos)
            if len(self.buffer) < n:  # the file was cut since it was opened
                self.file.check_unchanged()
                raise short_header(self.file, self.pos, n, what)
        return self.pos - self.start

    def take(self, n: int, what: str) -> bytes:
        at = self.fill(n, what)
        self.pos += n
        return self.buffer[at:at + n]

    def skip(self, n: int, what: str) -> None:
        if n > self.left():
            raise short_header(self.file, self.pos, n, what)
        self.pos += n

    def unpack(self, fmt: str, what: str) -> int | float:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> bytes:
        return self.take(int(self.unpack("Q", f"the length of {what}")), what)


def short_header(file: OpenedFile, pos: int, n: int, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{file.path}: its GGUF header needs {n} bytes for {what} at byte {pos}, but the file ends at byte "
        f"{file.size}. The file is truncated or damaged: download or convert it again.")


def damaged(file: OpenedFile, message: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{file.path}: {message}. The GGUF file is damaged or not one lightning_lowmem can "
                                 "read: download or convert it again.")


class Budget:
    """What the metadata may still keep: elements of arrays, and bytes."""

    def __init__(self, file: OpenedFile) -> None:
        self.file, self.elements, self.bytes = file, MAX_ARRAY_ELEMENTS, MAX_METADATA_BYTES

    def spend(self, key: str, elements: int, nbytes: int) -> None:
        self.elements -= elements
        self.bytes -= nbytes
        if self.elements < 0 or self.bytes < 0:
            raise damaged(self.file, f"metadata {key!r} takes the header past {MAX_ARRAY_ELEMENTS} array elements or "
                                     f"{MAX_METADATA_BYTES} bytes of metadata in all")


def read_value(cur: HeaderCursor, vtype: int, key: str, budget: Budget) -> int | float | bool | str | MetadataArray:
    """The value of field ``key`` (of ``GGUFValueType`` ``vtype``), the cursor on it."""
    if vtype in FORMATS:
        return cur.unpack(FORMATS[vtype], f"the value of {key!r}")
    if vtype == STRING:
        n = int(cur.unpack("Q", f"the length of {key!r}"))
        budget.spend(key, 0, n)
        return cur.take(n, f"the string {key!r}").decode("utf-8", errors="replace")
    if vtype == ARRAY:
        return _read_array(cur, key, budget)
    raise damaged(cur.file, f"metadata {key!r} has value type {vtype}, which GGUF does not define")


def _read_array(cur: HeaderCursor, key: str, budget: Budget) -> MetadataArray:
    itype, count = int(cur.unpack("I", f"the type of {key!r}")), int(cur.unpack("Q", f"the length of {key!r}"))
    if itype not in FORMATS and itype not in (STRING, ARRAY):
        raise damaged(cur.file, f"metadata {key!r} is an array of type {itype}, which GGUF does not define")
    smallest = SCALAR_BYTES.get(itype, 8 if itype == STRING else 12)  # a string or an array: its lengths at least
    if count * smallest > cur.left():
        raise damaged(cur.file, f"metadata {key!r} declares {count} elements of type {itype}, more than its "
                                f"{cur.left()} bytes left hold")
    budget.spend(key, count, count * (smallest if itype in FORMATS else _STRING_COST))
    if itype in FORMATS:
        raw = cur.take(count * smallest, f"the array {key!r}")
        return MetadataArray(itype, count, values=np.frombuffer(raw, _NUMPY[itype]))
    if itype == STRING:
        data, starts = _string_array(cur, count, key, budget)
        return MetadataArray(STRING, count, data=data, starts=starts)
    for _ in range(count):  # arrays of arrays: walked and bounded, not kept
        _skip_array(cur, key, budget, depth=1)
    return MetadataArray(ARRAY, count)


def _string_array(cur: HeaderCursor, count: int, key: str, budget: Budget) -> tuple[bytes, np.ndarray]:
    """``count`` strings from the cursor on: the bytes they take as stored, and where each string's bytes start.

    One pass over the cursor's buffer (a Python loop of a few operations per string: a 150k-token
    vocabulary in about 40 ms), the bytes collected block by block, each string's length checked
    against the bytes left in the file and in the budget before it is read.
    """
    starts, pieces, kept, room = array("q"), [], 0, budget.bytes
    at = cur.fill(0, f"the array {key!r}")
    first = at  # where the bytes not yet collected start in the buffer
    for _ in range(count):
        if at + 8 > len(cur.buffer):
            pieces.append(cur.buffer[first:at])
            kept, cur.pos = kept + at - first, cur.start + at
            at = first = cur.fill(8, f"the length of a string in {key!r}")
        n = int.from_bytes(cur.buffer[at:at + 8], "little")
        starts.append(kept + at + 8 - first)
        room -= n
        if room < 0:
            budget.spend(key, 0, budget.bytes + 1)  # raises, naming the key
        if at + 8 + n > len(cur.buffer):
            if n > cur.file.size - (cur.start + at + 8):
                raise short_header(cur.file, cur.start + at + 8, n, f"a string of {key!r}")
            pieces.append(cur.buffer[first:at])
            kept, cur.pos = kept + at - first, cur.start + at
            at = first = cur.fill(8 + n, f"a string of {key!r}")
        at += 8 + n
    pieces.append(cur.buffer[first:at])
    cur.pos = cur.start + at
    budget.bytes = room
    return b"".join(pieces), np.frombuffer(starts, dtype=np.int64)


def _skip_array(cur: HeaderCursor, key: str, budget: Budget, depth: int) -> None:
    """An array inside an array: checked against the bytes left and the budget, skipped."""
    itype, count = int(cur.unpack("I", f"the type of {key!r}")), int(cur.unpack("Q", f"the length of {key!r}"))
    if itype == ARRAY and depth >= _TOO_DEEP - 1:
        raise damaged(cur.file, f"metadata {key!r} has value type {ARRAY}, which GGUF does not define "
                                "(arrays nested too deep)")
    if itype not in FORMATS and itype not in (STRING, ARRAY):
        raise damaged(cur.file, f"metadata {key!r} is an array of type {itype}, which GGUF does not define")
    smallest = SCALAR_BYTES.get(itype, 8 if itype == STRING else 12)
    if count * smallest > cur.left():
        raise damaged(cur.file, f"metadata {key!r} declares {count} elements of type {itype}, more than its "
                                f"{cur.left()} bytes left hold")
    budget.spend(key, count, 0)
    if itype in FORMATS:
        cur.skip(count * smallest, f"the array {key!r}")
        return
    for _ in range(count):
        if itype == STRING:
            cur.skip(int(cur.unpack("Q", f"the length of {key!r}")), f"the string {key!r}")
        else:
            _skip_array(cur, key, budget, depth + 1)
