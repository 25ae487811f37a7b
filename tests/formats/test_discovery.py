"""Which files a checkpoint path stands for: formats told apart by content, directories, indexes, clear errors."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lightning_lowmem import AmbiguousCheckpointError, Checkpoint, CheckpointFormatError, CheckpointNotFoundError
from lightning_lowmem.formats.discovery import weight_sets


def test_a_directory_lists_its_weight_sets_in_the_documented_order(tmp_path, write_checkpoint):
    state = {"w": torch.ones(2)}
    write_checkpoint(state, "pth", tmp_path)
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    save_file({"w": torch.full((2,), 7.0)}, tmp_path / "model.safetensors")
    write_checkpoint({f"l{i}.w": torch.ones(2) for i in range(4)}, "sharded-safetensors", tmp_path / "shards")
    for name in ("optimizer.pt", "training_args.bin", ".model.safetensors.partial"):  # no weights, or a save's temp
        torch.save({"x": torch.ones(1)}, tmp_path / name)
    assert [s.name for s in weight_sets(tmp_path)] == ["model.safetensors", "lit_model.pth", "pytorch_model.bin"]
    sharded = weight_sets(tmp_path / "shards")
    assert [s.name for s in sharded] == ["model.safetensors.index.json"] and len(sharded[0].shards) == 4


def test_checkpoint_open_of_a_directory_with_several_sets_does_not_guess(tmp_path, write_checkpoint):
    """Which of several sets to read is the engine's resolver's decision (it compares them); opening the directory
    alone raises, naming them."""
    write_checkpoint({"w": torch.ones(2)}, "pth", tmp_path)
    save_file({"w": torch.full((2,), 7.0)}, tmp_path / "model.safetensors")
    with pytest.raises(AmbiguousCheckpointError, match=r"'model.safetensors', 'lit_model.pth'"):
        Checkpoint.open(tmp_path)


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


# ---------------------------------------------------------------- an index cannot leave its directory

_OPENED: list[str] = []  # every path opened from Python while the hook below records (audit hooks cannot be removed)
sys.addaudithook(lambda event, args: _OPENED.append(str(args[0])) if event == "open" else None)


def _index(directory: Path, weight_map: object) -> Path:
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors"])
def test_shard_names_outside_the_directory_are_refused_unopened(tmp_path, name):
    (tmp_path / "outside.safetensors").write_bytes(b"secret, never to be read")
    directory = tmp_path / "ckpt"
    directory.mkdir()
    save_file({"x": torch.ones(2)}, directory / "model-00001.safetensors")
    index = _index(directory, {"x": "model-00001.safetensors", "y": name})
    _OPENED.clear()
    with pytest.raises(CheckpointFormatError, match=r"names shard files outside its directory") as error:
        Checkpoint.open(index)
    assert "secret" not in str(error.value)
    assert not any(path.endswith(("outside.safetensors", "passwd")) for path in _OPENED)


def test_symlinked_shards_inside_the_directory_load(tmp_path):
    """The Hugging Face cache: a snapshot directory of symlinks into a blobs directory beside it."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    save_file({"x": torch.arange(3.0)}, blobs / "f00d")
    (snapshot / "model-00001.safetensors").symlink_to(blobs / "f00d")
    with Checkpoint.open(_index(snapshot, {"x": "model-00001.safetensors"})) as ckpt:
        assert torch.equal(ckpt.read("x"), torch.arange(3.0))


@pytest.mark.parametrize("weight_map", [["a", "b"], {"x": 5}, {"x": ["a"]}, {"x": None}, "model.safetensors"])
def test_a_weight_map_of_the_wrong_shape_is_a_typed_error(tmp_path, weight_map):
    with pytest.raises(CheckpointFormatError, match=r"weight_map"):
        Checkpoint.open(_index(tmp_path, weight_map))


@pytest.mark.parametrize("content", [b'{"weight_map": {"x": "\xff\xfe.safetensors"}}',
                                     b'{"weight_map": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_a_non_utf8_or_deeply_nested_index_is_a_typed_error(tmp_path, content):
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(content)
    with pytest.raises(CheckpointFormatError, match=r"not a sharded-checkpoint index"):
        Checkpoint.open(index)
