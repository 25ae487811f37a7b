"""measure_read_speed: a checkpoint's files read from their storage (O_DIRECT), or through the page cache."""

from __future__ import annotations

import os

import pytest

from lightning_lowmem.formats.read_speed import measure_read_speed


def test_reads_what_it_says_from_every_file_with_o_direct(tmp_path):
    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    files[0].write_bytes(os.urandom(3 * 2**20))
    files[1].write_bytes(os.urandom(2**20 + 13))  # not a whole number of pages
    speed = measure_read_speed(files, nbytes=2**20)
    assert 2**20 - 2 * 4096 <= speed.nbytes <= 2**20 + 4096 and speed.bytes_per_second > 0
    assert speed.direct == hasattr(os, "O_DIRECT") and "O_DIRECT" in str(speed)
    whole = measure_read_speed(files, nbytes=2**30)  # more than the files hold: each read once
    assert whole.nbytes <= 4 * 2**20 + 13


def test_asked_not_to_it_reads_through_the_page_cache(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(os.urandom(2**20))
    speed = measure_read_speed([path], nbytes=2**20, direct=False)
    assert not speed.direct and speed.nbytes == 2**20 and "page cache" in str(speed)


def test_nothing_to_read_is_an_error(tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(ValueError, match="holds no bytes"):
        measure_read_speed([tmp_path / "empty"])
