"""Checkpoint: every tensor of every format reads back equal, one at a time, without mapping the file."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_lowmem import Checkpoint, CheckpointFormatError

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
def test_every_tensor_reads_back_equal(tmp_path_factory, write_checkpoint, state, kind):
    path = write_checkpoint(state, kind, tmp_path_factory.mktemp("ckpt"))
    with Checkpoint.open(path) as ckpt:
        assert set(ckpt.records) == set(state)
        for key, tensor in state.items():
            rec = ckpt.records[key]
            assert (rec.shape, rec.dtype, rec.nbytes) == (tuple(tensor.shape), tensor.dtype,
                                                          tensor.numel() * tensor.element_size())
            assert torch.equal(ckpt.read(key), tensor)


def test_reads_do_not_map_the_file(tmp_path, write_checkpoint):
    """A tensor handed out must not keep the file mapped (it would pin all its pages)."""
    for kind in ("safetensors", "pth"):
        path = write_checkpoint({"w": torch.randn(256, 256)}, kind, tmp_path / kind)
        with Checkpoint.open(path) as ckpt:
            tensor = ckpt.read("w")
        maps = open(f"/proc/{os.getpid()}/maps").read()
        assert str(path) not in maps, kind
        assert tensor.sum().isfinite()


@pytest.mark.parametrize("kind", ["safetensors", "pth"])
def test_truncated_file(tmp_path, write_checkpoint, kind):
    path = write_checkpoint({"a": torch.randn(64, 64), "b": torch.randn(64)}, kind, tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 200])
    with pytest.raises(CheckpointFormatError, match="truncated") as err:
        Checkpoint.open(path)
    assert str(path) in str(err.value)


def test_metadata_of_safetensors_headers_and_of_a_torch_files_entry(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors", metadata={"format": "pt", "k": "v"})
    torch.save({"model": {"w": torch.ones(2), "__metadata__": {"k": "v"}}, "step": 1}, tmp_path / "m.ckpt")
    torch.save({"w": torch.ones(2), "__metadata__": {"k": 1}}, tmp_path / "bad.pt")  # not str -> str: none
    with Checkpoint.open(tmp_path / "m.safetensors") as a, Checkpoint.open(tmp_path / "m.ckpt") as b, \
            Checkpoint.open(tmp_path / "bad.pt") as c:
        assert (a.metadata, b.metadata, c.metadata) == ({"format": "pt", "k": "v"}, {"k": "v"}, {})
        assert list(b.records) == ["w"]
