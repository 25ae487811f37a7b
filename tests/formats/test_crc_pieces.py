"""A record's CRC-32 from pieces read apart: zlib's combination, gaps and overlaps, and the check every rank makes."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_lowmem import CheckpointFormatError
from lightning_lowmem.formats.crc_pieces import Piece, Unchecked, check_unchecked, combined, crc32_combine


@given(st.binary(max_size=300), st.binary(max_size=300))
def test_combine_is_the_crc_of_the_concatenation(a, b):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def _pieces(data: bytes, cuts: list[int]) -> list[Piece]:
    bounds = [0, *cuts, len(data)]
    return [Piece(start, stop - start, zlib.crc32(data[start:stop])) for start, stop in zip(bounds, bounds[1:])]


def test_pieces_in_any_order_combine_and_a_gap_is_not_checked():
    data = bytes(range(256)) * 5
    pieces = _pieces(data, [100, 700, 701])
    assert combined(list(reversed(pieces)), len(data)) == zlib.crc32(data)
    assert combined(pieces + pieces[:2], len(data)) == zlib.crc32(data)  # read twice: counted once
    assert combined(pieces[:1] + pieces[2:], len(data)) is None  # bytes 100..700 read by no one


def test_every_ranks_pieces_together_check_the_record():
    data = bytearray(bytes(range(256)) * 4)
    expected = zlib.crc32(data)
    ranks = [_pieces(bytes(data), [512])[:1], _pieces(bytes(data), [512])[1:]]
    shared = [[Unchecked("m.pth", "m/data/0", expected, len(data), tuple(p))] for p in ranks]
    check_unchecked(shared)  # intact: nothing raised
    data[600] ^= 1  # a flipped bit in the second rank's rows
    damaged = [[Unchecked("m.pth", "m/data/0", expected, len(data), tuple(p))] for p in
               ([_pieces(bytes(data), [512])[0]], [_pieces(bytes(data), [512])[1]])]
    with pytest.raises(CheckpointFormatError, match=r"m/data/0.*read in parts by several ranks.*CRC-32"):
        check_unchecked(damaged)
    check_unchecked([damaged[1], None])  # one rank's pieces alone cover nothing: not checked, not an error
