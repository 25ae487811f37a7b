"""GGUF files (written by gguf's own GGUFWriter, as llama.cpp's converter writes them): records from the header,
tensors dequantized by gguf's own code one at a time or by blocks of rows, no mapping kept, found by content,
and damaged files (cut short, offsets past the end, unknown types, bad magic, absurd counts) refused by name."""

from __future__ import annotations

import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_lowmem import AmbiguousCheckpointError, Checkpoint, CheckpointFormatError, CheckpointNotFoundError, init_empty, load_checkpoint
from lightning_lowmem.formats.gguf_file import DEQUANTIZE_ELEMENTS
from lightning_lowmem.plan.gguf import gguf_config, gguf_to_transformers


def _reference(path: Path) -> dict:
    """Every tensor as gguf's own reader and dequantizer give it (torch order, float32 for block types)."""
    import gguf

    reader = gguf.GGUFReader(path)
    out = {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
           for t in reader.tensors}
    del reader
    return out


def test_records_say_the_logical_shape_the_dtype_read_and_the_bytes_stored(tiny_gguf, gguf_kind):
    import gguf

    with Checkpoint.open(tiny_gguf[gguf_kind]) as ckpt:
        q, norm = ckpt.records["blk.0.attn_q.weight"], ckpt.records["blk.0.attn_norm.weight"]
        stored = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(tiny_gguf[gguf_kind]).tensors}
        assert {key: rec.nbytes for key, rec in ckpt.records.items()} == stored  # bytes read = bytes stored
    assert q.shape == (64, 64) and ckpt.records["blk.0.attn_k.weight"].shape == (32, 64)  # torch order: (out, in)
    assert ckpt.records["token_embd.weight"].shape == (303, 64)
    assert (norm.shape, norm.dtype, norm.encoding) == ((64,), torch.float32, None)
    if gguf_kind == "F16":
        assert (q.dtype, q.encoding, q.nbytes) == (torch.float16, None, 64 * 64 * 2)
    else:
        block_bytes = {"Q8_0": 34, "Q4_0": 18}[gguf_kind]  # 32 elements: an fp16 scale and 32 codes
        assert (q.dtype, q.encoding, q.nbytes) == (torch.float32, gguf_kind, 64 * 2 * block_bytes)
        assert q.tensor_nbytes == 64 * 64 * 4


def test_each_tensor_reads_as_gguf_dequantizes_it(tiny_gguf, gguf_kind):
    want = _reference(tiny_gguf[gguf_kind])
    with Checkpoint.open(tiny_gguf[gguf_kind]) as ckpt:
        for key, rec in ckpt.records.items():
            got = ckpt.read(key)
            assert got.dtype == rec.dtype and tuple(got.shape) == rec.shape
            assert torch.equal(got.float(), want[key].reshape(rec.shape)), key
            out = torch.full(rec.shape, float("nan"), dtype=rec.dtype)
            assert ckpt.read(key, out=out) is out and torch.equal(out, got)


def test_blocks_of_rows_read_alone_equal_the_whole(tiny_gguf, gguf_kind, monkeypatch):
    monkeypatch.setattr("lightning_lowmem.formats.gguf_file.DEQUANTIZE_ELEMENTS", 3 * 64)  # several blocks per read
    with Checkpoint.open(tiny_gguf[gguf_kind]) as ckpt:
        for key in ("token_embd.weight", "blk.1.ffn_down.weight", "blk.0.attn_k.weight"):
            whole = ckpt.read(key)
            assert ckpt.reads_rows(key)
            pieces = [ckpt.read_rows(key, start, min(start + 7, whole.shape[0])) for start in range(0, whole.shape[0], 7)]
            assert torch.equal(torch.cat(pieces), whole), key
        assert ckpt.reads_rows("blk.0.attn_norm.weight")  # a 1-d F32 tensor: rows are elements
    assert DEQUANTIZE_ELEMENTS >= 1 << 16


def test_opening_and_reading_keep_no_mapping_of_the_file(tiny_gguf):
    path = tiny_gguf["Q4_0"]

    def mapped() -> bool:
        return str(path) in Path("/proc/self/maps").read_text()

    with Checkpoint.open(path) as ckpt:
        assert not mapped()
        kept = [ckpt.read(key) for key in ckpt.records]
        assert not mapped()
    assert kept and not mapped()


def test_plain_tensors_can_be_mapped_block_quantized_ones_cannot(tiny_gguf):
    with Checkpoint.open(tiny_gguf["F16"]) as ckpt:
        mapped = ckpt.map("blk.0.attn_q.weight")
        assert mapped is not None and torch.equal(mapped, ckpt.read("blk.0.attn_q.weight"))
        del mapped
    with Checkpoint.open(tiny_gguf["Q4_0"]) as ckpt:
        assert ckpt.map("blk.0.attn_q.weight") is None  # dequantized as read
        assert torch.equal(ckpt.map("blk.0.attn_norm.weight"), ckpt.read("blk.0.attn_norm.weight"))  # F32


def test_found_by_content_and_alone_in_a_directory(tmp_path, tiny_gguf):
    renamed = tmp_path / "named" / "weights.bin"
    renamed.parent.mkdir()
    shutil.copy(tiny_gguf["Q8_0"], renamed)
    with Checkpoint.open(renamed) as ckpt:  # a .bin name, GGUF content
        assert ckpt.gguf is not None and ckpt.records["blk.0.attn_q.weight"].encoding == "Q8_0"
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(tiny_gguf["Q4_0"], alone / "model.Q4_0.gguf")
    with Checkpoint.open(alone) as ckpt:
        assert ckpt.paths == [alone / "model.Q4_0.gguf"]
    shutil.copy(tiny_gguf["Q8_0"], alone / "model.Q8_0.gguf")
    with pytest.raises(AmbiguousCheckpointError, match=r"2 weight sets.*model\.Q4_0\.gguf.*model\.Q8_0\.gguf"):
        Checkpoint.open(alone)


def _edit_tensor_field(path: Path, name: str, part: int, value) -> None:
    """Write ``value`` into part ``part`` of tensor ``name``'s header entry, with gguf's own reader in r+ mode
    (as gguf's gguf_set_metadata script edits files): 1 the name, 3 the dims, 4 the type, 5 the offset."""
    import gguf

    reader = gguf.GGUFReader(path, "r+")
    tensor = next(t for t in reader.tensors if t.name == name)
    tensor.field.parts[part][...] = value
    reader.data.flush()
    del reader, tensor


def _damage(path: Path, how: str) -> str:
    """Damage the GGUF file at ``path`` in place; the text the error must hold (beside the file's name)."""
    data = path.read_bytes()
    if how == "bad magic":
        path.write_bytes(b"GGUX" + data[4:])
        return "does not start with the GGUF magic"
    if how == "cut in the header":
        path.write_bytes(data[:200])
        return "truncated"
    if how == "cut in the data":
        path.write_bytes(data[:-100])
        return r"'output\.weight'.*past the end of the file"
    if how == "offset past the end":
        _edit_tensor_field(path, "blk.0.attn_q.weight", 5, 1 << 40)
        return r"'blk\.0\.attn_q\.weight'.*past the end of the file"
    if how == "unknown type":
        _edit_tensor_field(path, "blk.0.attn_k.weight", 4, 99)
        return r"'blk\.0\.attn_k\.weight'.*ggml type 99"
    if how == "a type of another size":
        _edit_tensor_field(path, "blk.0.attn_k.weight", 4, 2)  # Q8_0 -> Q4_0: the next tensor no longer follows
        return r"'blk\.0\.attn_v\.weight'.*does not follow the previous tensor's data"
    if how == "two tensors of one name":
        _edit_tensor_field(path, "blk.0.attn_q.weight", 1, np.frombuffer(b"blk.0.attn_k.weight", np.uint8))
        return r"'blk\.0\.attn_k\.weight' appears twice"
    if how == "big-endian":
        path.write_bytes(data[:4] + struct.pack(">I", 3) + data[8:])
        return "big-endian"
    raise ValueError(how)


DAMAGES = ["bad magic", "cut in the header", "cut in the data", "offset past the end", "unknown type",
           "a type of another size", "two tensors of one name", "big-endian"]


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_file_is_refused_by_name_and_the_module_is_untouched(tmp_path, tiny_gguf, how):
    import transformers

    good = tiny_gguf["Q8_0"]
    with init_empty():
        model = transformers.LlamaForCausalLM(gguf_config(good))
    conversion = gguf_to_transformers(good, model)
    path = tmp_path / "damaged.gguf"
    shutil.copy(good, path)
    expected = _damage(path, how)
    with pytest.raises(CheckpointFormatError, match=expected) as info:
        Checkpoint.open(path)
    assert "damaged.gguf" in str(info.value)
    with pytest.raises(CheckpointFormatError, match=expected):
        load_checkpoint(model, path, key_map=conversion.key_map, transform=conversion.transform, progress=False)
    assert all(p.is_meta for p in model.parameters())


def test_a_file_cut_during_the_load_leaves_the_module_as_it_was(tmp_path, tiny_gguf, monkeypatch):
    import transformers

    path = tmp_path / "cut-later.gguf"
    shutil.copy(tiny_gguf["Q4_0"], path)
    with init_empty():
        model = transformers.LlamaForCausalLM(gguf_config(path))
    conversion = gguf_to_transformers(path, model)
    real_read = Checkpoint.read

    def read_then_cut(self, key, *args, **kwargs):
        out = real_read(self, key, *args, **kwargs)
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
        return out

    monkeypatch.setattr(Checkpoint, "read", read_then_cut)
    with pytest.raises(CheckpointFormatError, match=r"cut-later\.gguf changed"):
        load_checkpoint(model, path, key_map=conversion.key_map, transform=conversion.transform, progress=False)
    assert all(p.is_meta for p in model.parameters())


def test_a_type_gguf_cannot_dequantize_is_refused_by_name(tmp_path, write_gguf_tensors):
    import gguf

    q8_1 = gguf.GGMLQuantizationType.Q8_1  # known to gguf, which has no dequantizer for it
    path = write_gguf_tensors(tmp_path / "q8_1.gguf", "llama",
                              {"blk.0.attn_k.weight": (np.zeros((2, 40), np.uint8), q8_1)})
    with pytest.raises(CheckpointFormatError, match=r"q8_1\.gguf: tensor 'blk\.0\.attn_k\.weight'.*Q8_1.*cannot dequantize"):
        Checkpoint.open(path)


def _header_with_array(count: int) -> bytes:
    """A GGUF header of one metadata array of ``count`` uint8 elements, and 64 bytes after it."""
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a" + struct.pack("<I", 9)
            + struct.pack("<IQ", 0, count) + b"\0" * 64)


@pytest.mark.parametrize("count", [10**8, 2**62])
def test_counts_the_file_cannot_hold_are_refused_at_once(tmp_path, count):
    """gguf's GGUFReader loops over such a count (10**6: 15 s and 0.9 GiB; 10**8: out of memory)."""
    path = tmp_path / "absurd.gguf"
    path.write_bytes(_header_with_array(count))
    start = time.perf_counter()
    with pytest.raises(CheckpointFormatError, match=rf"absurd\.gguf: metadata 'a' declares {count} elements"):
        Checkpoint.open(path)
    assert time.perf_counter() - start < 1.0


def test_a_split_file_says_how_to_merge_it(tmp_path, write_gguf_tensors):
    path = write_gguf_tensors(tmp_path / "model-00001-of-00002.gguf", "llama", {"w": np.zeros((2, 32), np.float32)},
                              fields={"split.count": 2})
    with pytest.raises(CheckpointFormatError, match=r"one of 2 parts.*llama-gguf-split --merge"):
        Checkpoint.open(path)


def test_a_missing_file_is_not_found(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        Checkpoint.open(tmp_path / "nothing.gguf")
