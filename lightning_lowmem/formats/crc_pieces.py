"""A zip record's CRC-32 checked from pieces read apart: blocks of rows, or each rank's rows of a sharded tensor.

A torch zip file records one CRC-32 per record. A reader that reads a record whole checks it at once; one
that reads it a block of rows at a time keeps a :class:`Pieces` per record: contiguous blocks are chained
as they come (``zlib.crc32(block, crc)``), and when the pieces cover the record its CRC-32 is checked. Ranks
that each read their own rows hold pieces of the same record; each sends the pieces it could not check
(:class:`Unchecked`) to the others, and every rank combines all of them (:func:`crc32_combine`, zlib's
algorithm: the CRC-32 of ``a + b`` from the CRC-32s of ``a`` and ``b`` and the length of ``b``) and checks
the record's CRC-32 (:func:`check_unchecked`). Every rank computes the same answer from the same pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from lightning_lowmem.errors import CheckpointFormatError

_POLY = 0xEDB88320  # CRC-32's polynomial, bits reversed


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo CRC-32's polynomial (bit-reversed polynomials, as zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while m:
        if a & m:
            p ^= b
            if not a & (m - 1):
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    """``x^(2^n)`` modulo the polynomial, ``n`` = 0..31."""
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)`` and ``len2 = len(b)`` (zlib's own).

    Example::

        >>> import zlib
        >>> crc32_combine(zlib.crc32(b"hello "), zlib.crc32(b"world"), 5) == zlib.crc32(b"hello world")
        True
    """
    p, n, k = 1 << 31, len2, 3  # x^0; x^(8 * len2) is x^(len2 * 2^3)
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


class Piece(NamedTuple):
    """``nbytes`` bytes of a record from byte ``start``, and their CRC-32."""

    start: int
    nbytes: int
    crc: int


class Unchecked(NamedTuple):
    """Pieces of a record this reader read but could not check alone: what another rank needs to check it."""

    path: str
    name: str  # the record's name in the archive
    expected: int  # the CRC-32 the zip directory records
    nbytes: int  # the record's length
    pieces: tuple[Piece, ...]


def mismatch(path: object, name: str, expected: int, crc: int, what: str) -> CheckpointFormatError:
    """The error for record ``name`` of ``path`` whose bytes have CRC-32 ``crc`` where ``expected`` is recorded."""
    return CheckpointFormatError(
        f"{path}: {what or name!r}: the bytes of record {name!r} do not match the CRC-32 its zip directory "
        f"records ({crc:#010x}, expected {expected:#010x}). The file is damaged: download or save it again.")


class Pieces:
    """The pieces read so far of one record of ``nbytes`` bytes whose CRC-32 is ``expected``."""

    def __init__(self, nbytes: int, expected: int) -> None:
        self.nbytes, self.expected = nbytes, expected
        self.pieces: list[Piece] = []

    def add(self, start: int, nbytes: int, crc_after: Callable[[int], int]) -> bool:
        """Add bytes ``start:start+nbytes``; ``crc_after(crc)`` is their CRC-32 continued from ``crc``. A piece
        that continues the last one is chained onto it. Returns whether the pieces now cover the record whole."""
        last = self.pieces[-1] if self.pieces else None
        if last is not None and last.start + last.nbytes == start:
            self.pieces[-1] = Piece(last.start, last.nbytes + nbytes, crc_after(last.crc))
        else:
            self.pieces.append(Piece(start, nbytes, crc_after(0)))
        first = self.pieces[0]
        if len(self.pieces) == 1:  # read in order (the usual case): no combining
            return first.start == 0 and first.nbytes == self.nbytes
        return combined(self.pieces, self.nbytes) is not None

    def crc(self) -> int | None:
        """The record's CRC-32 when the pieces cover it whole, else None."""
        return combined(self.pieces, self.nbytes)


def combined(pieces: Iterable[Piece], nbytes: int) -> int | None:
    """The CRC-32 of bytes ``0:nbytes`` from pieces that cover them (overlapping or repeated ones skipped), or
    None when some bytes are in no piece."""
    crc, at = 0, 0
    for piece in sorted(set(pieces)):
        if piece.start > at:
            return None  # a gap
        if piece.start < at:
            continue  # read twice (or overlapping): the first piece from here counts
        crc = crc32_combine(crc, piece.crc, piece.nbytes) if at else piece.crc
        at += piece.nbytes
    return crc if at == nbytes else None


def check_unchecked(shared: Iterable[Iterable[Unchecked]]) -> None:
    """Check every record that the pieces of all ranks (``shared``: each rank's :class:`Unchecked`) cover whole.

    Raises:
        CheckpointFormatError: a record's combined CRC-32 is not the one its zip directory records.
    """
    records: dict[tuple[str, str], Unchecked] = {}
    pieces: dict[tuple[str, str], list[Piece]] = {}
    for unchecked in shared:
        for record in unchecked or ():
            records.setdefault((record.path, record.name), record)
            pieces.setdefault((record.path, record.name), []).extend(record.pieces)
    for where, record in sorted(records.items()):
        crc = combined(pieces[where], record.nbytes)
        if crc is not None and crc != record.expected:
            raise mismatch(record.path, record.name, record.expected, crc,
                           f"{record.name} (read in parts by several ranks)")
