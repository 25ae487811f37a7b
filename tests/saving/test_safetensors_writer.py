"""Writing safetensors one tensor at a time: the bytes ``save_file`` writes, shards as ``save_pretrained`` cuts them."""

from __future__ import annotations

import gc
import json
import struct
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_lowmem import Checkpoint
from lightning_lowmem.saving.safetensors_writer import (
    WRITER_KEY,
    TensorToWrite,
    plan_sharded,
    shard_names,
    split_shards,
    write_safetensors,
    write_sharded,
)

TENSORS = {"b": torch.arange(3, dtype=torch.uint8), "a": torch.randn(2, 3).to(torch.bfloat16), "c": torch.randn(5),
           "scalar": torch.tensor(7, dtype=torch.uint8), "i8": torch.tensor([-1, 2], dtype=torch.int8),
           "f64": torch.randn(1, dtype=torch.float64), "f16": torch.randn(3, dtype=torch.float16),
           "empty": torch.zeros(0, 4), "flag": torch.tensor([True, False]), "i64": torch.arange(3)}


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {"format": "pt", "lightning_lowmem.quantize": "bnb.nf4"}])
def test_the_bytes_are_those_save_file_writes(tmp_path, metadata):
    save_file(TENSORS, tmp_path / "theirs.safetensors", metadata=metadata)
    write_safetensors(tmp_path / "ours.safetensors", [TensorToWrite.of(k, v) for k, v in TENSORS.items()], metadata)
    ours, theirs = (tmp_path / "ours.safetensors").read_bytes(), (tmp_path / "theirs.safetensors").read_bytes()
    if not metadata or len(metadata) == 1:
        assert ours == theirs
    else:  # save_file orders metadata entries at random from one run to the next (a hash map): all else is equal
        size = struct.unpack("<Q", ours[:8])[0]
        assert ours[:8] == theirs[:8] and ours[8 + size:] == theirs[8 + size:]
        assert json.loads(ours[8:8 + size]) == json.loads(theirs[8:8 + size])


def test_each_tensor_is_made_when_it_is_written_and_dropped_before_the_next(tmp_path):
    alive: list[weakref.ref] = []

    def make(key: str, n: int):
        def get() -> torch.Tensor:
            gc.collect()
            assert all(ref() is None for ref in alive), f"{key}: an earlier tensor is still alive"
            tensor = torch.full((n,), n, dtype=torch.float32)
            alive.append(weakref.ref(tensor))
            return tensor

        return TensorToWrite(key, (n,), torch.float32, get)

    write_safetensors(tmp_path / "m.safetensors", [make(f"t{n}", n) for n in range(1, 6)])
    assert {k: v[0].item() for k, v in load_file(tmp_path / "m.safetensors").items()} == {
        f"t{n}": n for n in range(1, 6)}


def test_a_tensor_that_is_not_what_was_announced_leaves_no_file(tmp_path):
    wrong = TensorToWrite("w", (2, 2), torch.float32, lambda: torch.zeros(4))
    with pytest.raises(ValueError, match=r"'w' was announced as torch.float32 \[2, 2\] but is torch.float32 \[4\]"):
        write_safetensors(tmp_path / "m.safetensors", [wrong])
    assert list(tmp_path.iterdir()) == []


def test_shards_are_cut_as_huggingface_hub_cuts_them():
    from huggingface_hub import split_torch_state_dict_into_shards

    state = {f"t{i}": torch.zeros(n, dtype=torch.uint8) for i, n in enumerate([30, 50, 10, 200, 40, 40, 5, 90])}
    theirs = split_torch_state_dict_into_shards(state, max_shard_size=100)
    ours = split_shards([TensorToWrite.of(k, v) for k, v in state.items()], 100)
    names = shard_names(len(ours))
    assert {t.key: name for name, shard in zip(names, ours) for t in shard} == theirs.tensor_to_filename


def test_a_sharded_set_loads_through_its_index_and_its_sizes_are_known_before_it_is_written(tmp_path):
    tensors = [TensorToWrite.of(f"layer.{i}.weight", torch.full((64,), float(i))) for i in range(6)]
    plan = plan_sharded(tensors, {"format": "pt"}, max_shard_size=600)
    files = write_sharded(tmp_path, plan)
    assert [p.name for p in files] == [*shard_names(3), "model.safetensors.index.json"]
    assert [p.stat().st_size for p in files] == plan.sizes
    index = json.loads(files[-1].read_text())
    assert index["metadata"] == {"total_size": 6 * 256, WRITER_KEY: "lightning_lowmem"}
    assert len(index["weight_map"]) == 6
    with Checkpoint.open(tmp_path) as ckpt:
        assert ckpt.metadata == {"format": "pt"}
        assert [ckpt.read(f"layer.{i}.weight")[0].item() for i in range(6)] == [float(i) for i in range(6)]
    (tmp_path / "one").mkdir()
    assert [p.name for p in write_sharded(tmp_path / "one", plan_sharded(tensors[:1], {}, 600))] == [
        "model.safetensors"]


def test_nothing_is_written_through_a_link_at_the_name(tmp_path):
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "model.safetensors").symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_sharded(tmp_path / "d", plan_sharded([TensorToWrite.of("w", torch.ones(4))], {}, 600))
    assert victim.read_bytes() == b"precious" and (tmp_path / "d" / "model.safetensors").is_symlink()
