"""A GGUF header's metadata read in one bounded pass: arrays kept compact and equal to what gguf's own reader reads,
totals bounded, and a file cut while its header is read refused by name."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from lightning_lowmem import Checkpoint, CheckpointFormatError
from lightning_lowmem.formats.files import OpenedFile


def _gguf_reader_arrays(path) -> dict:
    """Every array field as gguf's own GGUFReader decodes it (strings as UTF-8)."""
    import gguf

    reader = gguf.GGUFReader(path)
    out = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            parts = [field.parts[i] for i in field.data]
            strings = field.types[-1] == gguf.GGUFValueType.STRING
            out[key] = [bytes(p).decode() if strings else p.tolist()[0] for p in parts]
    del reader
    return out


@pytest.mark.parametrize("vocabulary", ["spm", "bpe"])
def test_arrays_read_as_gguf_reads_them_and_kept_compact(tmp_path, tiny_gguf, gguf_chat_model, vocabulary):
    path = tiny_gguf["Q8_0"] if vocabulary == "spm" else gguf_chat_model
    want = _gguf_reader_arrays(path)
    with Checkpoint.open(path) as ckpt:
        arrays = ckpt.gguf.layout.arrays
        assert set(arrays) == set(want)
        for key, array in arrays.items():
            assert array.tolist() == pytest.approx(want[key]) if key.endswith("scores") else array.tolist() == want[key]
            assert len(array) == len(want[key])
        tokens = arrays["tokenizer.ggml.tokens"]
        assert tokens.string(1) == want["tokenizer.ggml.tokens"][1]
        per_token = tokens.nbytes / len(tokens)  # its bytes as stored + its offset: no Python object per token
        assert per_token <= 16 + max(len(t.encode()) for t in want["tokenizer.ggml.tokens"])
        assert isinstance(arrays["tokenizer.ggml.token_type"].values, np.ndarray)


def _cut_after_first_read(monkeypatch, path) -> None:
    """The file is cut to half its size right after the header's first block is read (as another process might)."""
    real = OpenedFile.pread

    def pread_then_cut(self, size, offset):
        out = real(self, size, offset)
        if self.path == path and path.stat().st_size > 2**20:
            with open(path, "r+b") as f:
                f.truncate(2**20 + 100)
        return out

    monkeypatch.setattr(OpenedFile, "pread", pread_then_cut)


def test_a_file_cut_while_its_header_is_read_is_refused_by_name(tmp_path, write_gguf, monkeypatch):
    """A 3 MiB header (a 300k-string array): read in 1 MiB blocks, the second finds the file cut."""
    path = tmp_path / "cut.gguf"
    write_gguf(path, "Q8_0", fields={"x.junk": [f"s{i}" for i in range(300_000)]})
    _cut_after_first_read(monkeypatch, path)
    with pytest.raises(CheckpointFormatError, match=r"cut\.gguf (changed|.*truncated)"):
        Checkpoint.open(path)


def test_totals_are_bounded(tmp_path, write_gguf, monkeypatch):
    path = tmp_path / "big.gguf"
    write_gguf(path, "Q8_0", fields={"x.junk": ["abcdefgh"] * 5000})
    monkeypatch.setattr("lightning_lowmem.formats.gguf_metadata.MAX_METADATA_BYTES", 60_000)
    with pytest.raises(CheckpointFormatError, match=r"big\.gguf: metadata 'x\.junk' takes the header past"):
        Checkpoint.open(path)
    monkeypatch.setattr("lightning_lowmem.formats.gguf_metadata.MAX_METADATA_BYTES", 1 << 28)
    monkeypatch.setattr("lightning_lowmem.formats.gguf_metadata.MAX_ARRAY_ELEMENTS", 4000)
    with pytest.raises(CheckpointFormatError, match=r"'x\.junk' takes the header past 4000 array elements"):
        Checkpoint.open(path)
    copy = tmp_path / "copy.gguf"
    shutil.copy(path, copy)
    monkeypatch.setattr("lightning_lowmem.formats.gguf_header.MAX_ENTRIES", 10)
    with pytest.raises(CheckpointFormatError, match=r"copy\.gguf: .*declares 21 tensors, more than the 10 read"):
        Checkpoint.open(copy)
