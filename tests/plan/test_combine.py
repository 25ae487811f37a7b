"""Combine: one module tensor built from several checkpoint keys (q, k and v into one qkv), parts read together."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem import CheckpointMismatchError, Combine, init_empty, load_checkpoint


@pytest.fixture
def split_qkv(tmp_path, write_checkpoint):
    """``split_qkv(directory, drop=None)``: a q/k/v split checkpoint (GQA widths 16, 8, 8) of a module that holds
    one fused ``qkv`` Linear; returns the parts, the path, the module on meta and the Combine."""
    def make(directory, drop: str | None = None):
        torch.manual_seed(0)
        parts = {f"{layer}.{p}.weight": torch.randn(width, 16) for layer in "ab" for p, width in zip("qkv", (16, 8, 8))}
        parts["a.proj.weight"] = torch.randn(16, 16)
        if drop:
            del parts[drop]
        path = write_checkpoint(parts, "safetensors", directory)
        with init_empty():
            module = nn.ModuleDict({"a": nn.ModuleDict({"qkv": nn.Linear(16, 32, bias=False),
                                                        "proj": nn.Linear(16, 16, bias=False)}),
                                    "b": nn.ModuleDict({"qkv": nn.Linear(16, 32, bias=False)})})
        sources = {f"{layer}.qkv.weight": tuple(f"{layer}.{p}.weight" for p in "qkv") for layer in "ab"}
        combine = Combine(sources, lambda name, got: torch.cat([got[key] for key in sources[name]]))
        return parts, path, module, combine

    return make


def test_combine_builds_one_tensor_from_several_keys(tmp_path, split_qkv, read_recorder):
    parts, path, module, combine = split_qkv(tmp_path)
    report = load_checkpoint(module, path, dtype=torch.bfloat16, combine=combine)

    for layer in "ab":
        fused = torch.cat([parts[f"{layer}.{p}.weight"] for p in "qkv"]).to(torch.bfloat16)
        assert torch.equal(module[layer].qkv.weight, fused)
        assert module[layer].qkv.weight.untyped_storage().nbytes() == fused.nbytes
    assert read_recorder.keys == ["a.q.weight", "a.k.weight", "a.v.weight", "a.proj.weight",  # module order,
                                  "b.q.weight", "b.k.weight", "b.v.weight"]                  # parts together
    assert report.tensors == 7 and report.bytes_read == sum(t.nbytes for t in parts.values())
    assert report.skipped == [] and report.missing == []


def test_combine_missing_part_and_bad_shape_fail_before_reading(tmp_path, split_qkv, read_recorder):
    _, path, module, combine = split_qkv(tmp_path / "missing", drop="b.k.weight")
    with pytest.raises(CheckpointMismatchError, match=r"'b\.k\.weight' for 'b\.qkv\.weight'") as err:
        load_checkpoint(module, path, combine=combine)
    assert "b.q.weight" not in str(err.value)  # the parts that are there are not "unexpected"

    _, path, module, combine = split_qkv(tmp_path / "wide")
    with init_empty():
        module["b"]["qkv"] = nn.Linear(16, 48, bias=False)
    with pytest.raises(CheckpointMismatchError, match=r"'b\.qkv\.weight' built from 'b\.q\.weight'.*\[32, 16\]"):
        load_checkpoint(module, path, combine=combine)
    assert read_recorder.keys == []
