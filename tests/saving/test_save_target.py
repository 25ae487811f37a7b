"""The directory a checkpoint is saved into: an earlier save of this library told apart from weight files it did not
write, and every check made before a byte is written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from lightning_lowmem import ForeignWeightsError, SaveError
from lightning_lowmem.saving.save_target import check_save_target, checkpoint_directory, weight_files

TENSOR = {"w": torch.ones(2)}


def test_an_earlier_save_is_told_apart_from_weight_files_it_did_not_write(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    save_file(TENSOR, ours / "model.safetensors", metadata={"format": "pt", "lightning_lowmem.writer": "lightning_lowmem"})
    for i in (1, 2):  # a sharded save of an earlier version: its shards carry the scheme, its index nothing
        save_file(TENSOR, ours / f"model-0000{i}-of-00002.safetensors", metadata={"lightning_lowmem.quantize": "bnb.nf4"})
    (ours / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"}}))
    (ours / "README.md").write_text("not weights")
    (ours / "config.safetensors").mkdir()  # a folder is no weight file
    save_file(TENSOR, theirs / "model.safetensors", metadata={"format": "pt"})  # as save_pretrained writes it
    save_file(TENSOR, theirs / "adapter.safetensors", metadata={"lightning_lowmem.writer": "lightning_lowmem"})  # renamed
    (theirs / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {}}))
    (theirs / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    for name in ("lit_model.pth", "x.pt", "fit.ckpt", "m.gguf"):
        (theirs / name).write_bytes(b"\0" * 16)
    (theirs / "dangling.bin").symlink_to("nowhere")  # nothing a loader can read
    assert weight_files(ours) == (["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                   "model.safetensors", "model.safetensors.index.json"], [])
    assert weight_files(theirs) == ([], ["adapter.safetensors", "fit.ckpt", "lit_model.pth", "m.gguf",
                                         "model.safetensors", "model.safetensors.index.json",
                                         "pytorch_model.bin.index.json", "x.pt"])


def test_a_save_target_is_checked_before_anything_is_written(tmp_path, mount_tmpfs):
    (tmp_path / "file").write_text("f")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        check_save_target(tmp_path / "file")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "pytorch_model.bin").write_bytes(b"PK\x03\x04")
    with pytest.raises(ForeignWeightsError, match=r"did not write: 'pytorch_model.bin'.*overwrite=True") as e:
        check_save_target(tmp_path / "d")
    assert e.value.files == ["pytorch_model.bin"] and isinstance(e.value, SaveError)
    assert check_save_target(tmp_path / "d", overwrite=True) == tmp_path / "d"
    disk = mount_tmpfs("64k")
    with pytest.raises(SaveError, match=r"needs 136.00 KiB \(139264 bytes\) on the file system of .* which has 64.00 "
                                        r"KiB \(65536 bytes\) free\. Free 72.00 KiB") as e:
        check_save_target(disk / "new" / "out", sizes=[100_000, 30_000])  # whole 4 KiB blocks, and one for the folder
    assert (e.value.needed, e.value.available, e.value.errno) == (139264, 65536, 28)
    assert list(disk.iterdir()) == []


def test_weight_files_that_appear_while_the_save_runs_stop_it(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(ForeignWeightsError, match="'lit_model.pth'"), checkpoint_directory(tmp_path / "out") as new:
        (new / "model.safetensors").write_bytes(b"new")
        (tmp_path / "out" / "lit_model.pth").write_bytes(b"PK")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["lit_model.pth"]
    with checkpoint_directory(tmp_path / "out", overwrite=True) as new:
        (new / "model.safetensors").write_bytes(b"new")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
