"""Combine: one module tensor built from several checkpoint keys (q, k and v into one qkv), parts read together."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem import Checkpoint, CheckpointMismatchError, Combine, init_empty, load_checkpoint
from lightning_lowmem.formats import TensorRecord
from lightning_lowmem.plan.combine import Stack, with_stacks


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


def test_a_combine_that_lays_its_parts_out_whole_is_read_straight_into_its_rows(tmp_path, split_qkv, read_recorder):
    """``with_stacks`` finds, by running ``fn`` on row numbers, that q, k, v concatenated are a stack: each part is
    then read straight into its rows of the tensor, allocated once."""
    parts, path, module, combine = split_qkv(tmp_path)
    with Checkpoint.open(path) as ckpt:
        stacked = with_stacks(combine, ckpt.records)
    assert stacked.stacks == {f"{layer}.qkv.weight": Stack((0, 16, 24), (16,)) for layer in "ab"}

    report = load_checkpoint(module, path, combine=stacked)
    for layer in "ab":
        assert torch.equal(module[layer].qkv.weight, torch.cat([parts[f"{layer}.{p}.weight"] for p in "qkv"]))
    assert sorted(read_recorder.keys) == sorted(parts) and report.bytes_read == sum(t.nbytes for t in parts.values())


@pytest.mark.parametrize("fn", [
    lambda got: torch.cat([got["q"], got["k"]]) * 2,  # computes on the values
    lambda got: torch.cat([got["q"], got["k"]]).abs(),  # the identity on row numbers
    lambda got: torch.cat([got["q"], got["k"]]).flip(-1),  # the identity with rows of one column
    lambda got: torch.cat([got["q"], got["k"]])[:, [1, 0, *range(2, 8)]],  # a column permutation
    lambda got: torch.cat([got["q"], got["k"]], dim=1),  # joins along the rows' own dimension
    lambda got: torch.cat([got["q"], got["q"]]),  # reads a part twice
], ids=["values", "abs", "flip", "column permutation", "columns", "repeated"])
def test_anything_but_whole_rows_of_the_parts_is_built_by_its_fn(fn):
    from pathlib import Path

    records = {k: TensorRecord(k, (4, 8), torch.float32, Path("m.safetensors")) for k in ("q", "k")}
    combine = with_stacks(Combine({"qk": ("q", "k")}, lambda name, got: fn(got)), records)
    assert combine.stacks == {}


@pytest.mark.parametrize("conversion", [
    lambda q, k: torch.cat([q, k]).flip(-1),
    lambda q, k: torch.cat([q, k]).abs(),
    lambda q, k: torch.cat([q, k])[:, [1, 0, *range(2, 16)]],
], ids=["flip", "abs", "column permutation"])
def test_a_conversion_that_is_the_identity_on_rows_of_one_column_loads_exactly(tmp_path, split_qkv, conversion):
    """Such a conversion passed the old probe (row numbers with trailing dimensions of size 1), and the stacked
    route then never ran it: the module got the parts unconverted. Probed at the real shapes, it is built by fn."""
    parts, path, module, _ = split_qkv(tmp_path)
    combine = Combine({f"{layer}.qkv.weight": tuple(f"{layer}.{p}.weight" for p in "qk") for layer in "ab"},
                      lambda name, got: conversion(*got.values()))
    with Checkpoint.open(path) as ckpt:
        combine = with_stacks(combine, ckpt.records)  # as the conversions find their stacks
    assert combine.stacks == {}
    with init_empty():
        for layer in "ab":
            module[layer]["qkv"] = nn.Linear(16, 24, bias=False)
    load_checkpoint(module, path, combine=combine, strict=False)
    for layer in "ab":
        expected = conversion(parts[f"{layer}.q.weight"], parts[f"{layer}.k.weight"])
        assert torch.equal(module[layer].qkv.weight, expected)


def test_rows_interleaved_from_two_parts_are_a_stack_of_runs(tmp_path, split_qkv):
    """Whole rows of the parts, in another order, found at the real shapes: read a run at a time, exactly."""
    from pathlib import Path

    interleave = lambda name, got: torch.stack(list(got.values()), dim=1).reshape(-1, 8)  # noqa: E731  q0 k0 q1 k1
    records = {k: TensorRecord(k, (4, 8), torch.float32, Path("m.safetensors")) for k in ("q", "k")}
    stack = with_stacks(Combine({"qk": ("q", "k")}, interleave), records).stacks["qk"]
    assert stack.runs == tuple((i, row, 1, 2 * row + i) for i in (0, 1) for row in range(4))


def test_a_stack_must_tile_the_result():
    assert Stack((0, 4), (8,)).fits([(4, 8), (4, 8)], (8, 8))
    assert Stack((0, 4), (8,)).fits([(4, 8), (4, 8)], (2, 4, 8))  # experts x rows x columns
    assert not Stack((0, 3), (8,)).fits([(4, 8), (4, 8)], (8, 8))  # overlapping
    assert not Stack((0, 4), (8,)).fits([(4, 8), (4, 8)], (9, 8))  # a row left unfilled
    assert not Stack((0, 4), (8,)).fits([(4, 8), (4, 4)], (8, 8))  # another row shape


def test_rows_reordered_within_a_part_are_found_as_runs_and_must_tile_both_ways():
    from pathlib import Path

    def reorder(got):  # rows a0 b0 a1 b1 of one part -> a0 a1 b0 b1 (GPT-NeoX's q, k, v by head, in small)
        x = got["ab"]
        return torch.cat([x[0:2], x[4:6], x[2:4], x[6:8]])

    records = {"ab": TensorRecord("ab", (8, 3), torch.float32, Path("m.safetensors"))}
    stack = with_stacks(Combine({"t": ("ab",)}, lambda name, got: reorder(got)), records).stacks["t"]
    assert stack.runs == ((0, 0, 2, 0), (0, 2, 2, 4), (0, 4, 2, 2), (0, 6, 2, 6))
    assert stack.fits([(8, 3)], (8, 3)) and not stack.fits([(6, 3)], (6, 3))
    assert stack.pieces([8], 3, 7) == [(0, 5, 6, 0), (0, 2, 4, 1), (0, 6, 7, 3)]  # rows 3:7 of the result
    x = torch.arange(24.0).view(8, 3)
    rebuilt = torch.empty(8, 3)
    for _, lo, hi, at in stack.pieces([8], 0, 8):
        rebuilt[at:at + hi - lo] = x[lo:hi]
    assert torch.equal(rebuilt, reorder({"ab": x}))
    assert not Stack((0,), (3,), runs=((0, 0, 4, 0), (0, 2, 4, 4))).fits([(8, 3)], (8, 3))  # part rows twice
    assert not Stack((0,), (3,), runs=((0, 0, 4, 0), (0, 4, 4, 2))).fits([(8, 3)], (8, 3))  # result rows twice
