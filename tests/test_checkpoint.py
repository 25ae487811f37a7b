"""Reading checkpoints: detection by content, per-tensor reads, and clear errors on bad input."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from conftest import write_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from lightning_lowmem import (
    Checkpoint,
    CheckpointFormatError,
    CheckpointNotFoundError,
    UnsafeCheckpointError,
    init_empty,
    load_checkpoint,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]


@st.composite
def state_dicts(draw):
    n = draw(st.integers(1, 5))
    state = {}
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        state[f"layer{i}.w"] = (torch.rand(shape) * 100).to(dtype)
    return state


@settings(max_examples=30, deadline=None)
@given(state=state_dicts(), kind=st.sampled_from(["safetensors", "pth", "lightning"]))
def test_every_tensor_reads_back_equal(tmp_path_factory, state, kind):
    path = write_checkpoint(state, kind, tmp_path_factory.mktemp("ckpt"))
    with Checkpoint.open(path) as ckpt:
        assert set(ckpt.records) == set(state)
        for key, tensor in state.items():
            rec = ckpt.records[key]
            assert (rec.shape, rec.dtype, rec.nbytes) == (tuple(tensor.shape), tensor.dtype,
                                                          tensor.numel() * tensor.element_size())
            assert torch.equal(ckpt.read(key), tensor)


def test_views_and_shared_storage_in_torch_files(tmp_path):
    base = torch.randn(8, 6)
    state = {"full": base, "rows": base[2:5], "transposed": base.t()}
    torch.save(state, tmp_path / "views.pt")
    with Checkpoint.open(tmp_path / "views.pt") as ckpt:
        for key, tensor in state.items():
            out = ckpt.read(key)
            assert torch.equal(out, tensor)
            assert out.untyped_storage().nbytes() == tensor.numel() * 4 or key == "transposed"


def test_reads_do_not_map_the_file(tmp_path):
    """A tensor handed out must not keep the file mapped (it would pin all its pages)."""
    for kind in ("safetensors", "pth"):
        path = write_checkpoint({"w": torch.randn(256, 256)}, kind, tmp_path / kind)
        with Checkpoint.open(path) as ckpt:
            tensor = ckpt.read("w")
        maps = open(f"/proc/{os.getpid()}/maps").read()
        assert str(path) not in maps, kind
        assert tensor.sum().isfinite()


def test_directory_prefers_safetensors_and_says_so(tmp_path, caplog):
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


@pytest.mark.parametrize("kind", ["safetensors", "pth"])
def test_truncated_file(tmp_path, kind):
    path = write_checkpoint({"a": torch.randn(64, 64), "b": torch.randn(64)}, kind, tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 200])
    with pytest.raises(CheckpointFormatError, match="truncated") as err:
        Checkpoint.open(path)
    assert str(path) in str(err.value)


def test_torch_file_with_data_cut_short_is_caught_from_headers(tmp_path):
    """A zip whose central directory survives but whose data is cut is caught before reading."""
    import zipfile

    torch.save({"w": torch.randn(1000)}, tmp_path / "src.pt")
    with zipfile.ZipFile(tmp_path / "src.pt") as src, zipfile.ZipFile(tmp_path / "cut.pt", "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, data[:100] if info.filename.endswith("data/0") else data)
    with pytest.raises(CheckpointFormatError, match=r"'w'.*truncated"):
        Checkpoint.open(tmp_path / "cut.pt")


def test_missing_shard_names_index_shard_and_keys(tmp_path):
    state = {f"layer{i}.w": torch.randn(4) for i in range(8)}
    index = write_checkpoint(state, "sharded-safetensors", tmp_path)
    (tmp_path / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(CheckpointNotFoundError) as err:
        Checkpoint.open(index)
    message = str(err.value)
    assert "model-00003-of-00004.safetensors" in message and "layer2.w" in message
    assert "index.json" in message


def test_pickle_that_runs_code_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"w": torch.ones(2), "payload": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"evil\.pt.*GLOBAL.*system.*add_safe_globals"):
        load_checkpoint(torch.nn.Linear(2, 1), tmp_path / "evil.pt")
    assert not marker.exists()


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


def test_errors_leave_a_meta_module_untouched(tmp_path):
    with init_empty():
        layer = torch.nn.Linear(4, 4)
    with pytest.raises(CheckpointNotFoundError):
        load_checkpoint(layer, tmp_path / "missing.safetensors")
    assert layer.weight.is_meta and layer.bias.is_meta
