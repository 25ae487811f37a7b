"""Which files a checkpoint path stands for: formats told apart by content, directories, indexes, clear errors."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from lightning_lowmem import Checkpoint, CheckpointFormatError, CheckpointNotFoundError


def test_directory_prefers_safetensors_and_says_so(tmp_path, write_checkpoint, caplog):
    state = {"w": torch.ones(2)}
    write_checkpoint(state, "pth", tmp_path)
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    save_file({"w": torch.full((2,), 7.0)}, tmp_path / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="lightning_lowmem"), Checkpoint.open(tmp_path) as ckpt:
        assert ckpt.paths == [tmp_path / "model.safetensors"]
        assert torch.equal(ckpt.read("w"), torch.full((2,), 7.0))
    assert "using model.safetensors" in caplog.text and "lit_model.pth" in caplog.text


def test_format_is_detected_by_content_not_name(tmp_path):
    save_file({"w": torch.ones(3)}, tmp_path / "weights.bin")  # safetensors under a pickle name
    torch.save({"w": torch.zeros(3)}, tmp_path / "weights.safetensors")  # and the other way round
    with Checkpoint.open(tmp_path / "weights.bin") as ckpt:
        assert torch.equal(ckpt.read("w"), torch.ones(3))
    with Checkpoint.open(tmp_path / "weights.safetensors") as ckpt:
        assert torch.equal(ckpt.read("w"), torch.zeros(3))


def test_missing_shard_names_index_shard_and_keys(tmp_path, write_checkpoint):
    state = {f"layer{i}.w": torch.randn(4) for i in range(8)}
    index = write_checkpoint(state, "sharded-safetensors", tmp_path)
    (tmp_path / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(CheckpointNotFoundError) as err:
        Checkpoint.open(index)
    message = str(err.value)
    assert "model-00003-of-00004.safetensors" in message and "layer2.w" in message
    assert "index.json" in message


def test_legacy_and_garbage_files(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointFormatError, match="legacy format"):
        Checkpoint.open(tmp_path / "legacy.pt")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointFormatError, match="neither a safetensors file"):
        Checkpoint.open(tmp_path / "notes.txt")
    (tmp_path / "bad.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointFormatError, match="weight_map"):
        Checkpoint.open(tmp_path / "bad.index.json")


def test_missing_path_and_empty_directory(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        Checkpoint.open(tmp_path / "nope.safetensors")
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        Checkpoint.open(tmp_path)
