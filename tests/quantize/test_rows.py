"""Quantizing a block of rows at a time: weights are never read whole, odd shapes, a file cut short mid-weight."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import lightning_lowmem.quantize.rows as rows
from lightning_lowmem import CheckpointFormatError, init_empty, load_checkpoint
from lightning_lowmem.quantize import schemes_available_on

ON_CPU = schemes_available_on(torch.device("cpu"))


@pytest.mark.parametrize("scheme", [s for s in ["bnb.nf4-dq", "bnb.fp4", "bnb.int8", "torchao.int8wo"] if s in ON_CPU])
def test_odd_shapes_chunked(tmp_path, scheme, monkeypatch, quantize_after_load, assert_same_weights):
    """Rows of 100 elements: 4-bit blocks of 64 straddle rows, and the weight has an odd element count."""
    monkeypatch.setattr(rows, "CHUNK_ELEMENTS", 300)
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(100, 37), nn.GELU(), nn.Linear(37, 13, bias=False)).to(torch.bfloat16)
    save_file(source.state_dict(), tmp_path / "m.safetensors")
    with init_empty():
        model = nn.Sequential(nn.Linear(100, 37), nn.GELU(), nn.Linear(37, 13, bias=False))
    report = load_checkpoint(model, tmp_path / "m.safetensors", dtype=torch.bfloat16, quantize=scheme)
    ref = quantize_after_load(source, scheme, skip=())
    assert set(report.quantized) == {"0", "2"}
    assert_same_weights(model, ref)
    x = torch.randn(3, 100, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["safetensors", "sharded-safetensors", "pth", "lightning", "fp32-safetensors"])
@pytest.mark.parametrize("scheme", [s for s in ["bnb.nf4-dq", "bnb.int8", "torchao.int8wo"] if s in ON_CPU])
def test_weights_read_by_rows_from_every_format(tmp_path, scheme, kind, monkeypatch, quant_config, tiny_gpt,
                                                write_checkpoint, quant_load, quantize_after_load,
                                                assert_same_weights, forward_logits, read_recorder):
    """Weights are read from the file a block of rows at a time (never whole), in every format.

    Blocks of 1000 elements (7 rows) and a ragged last block; an fp32 file is cast block by block. The
    result must be the bytes the library gives after a full bf16 load.
    """
    monkeypatch.setattr(rows, "CHUNK_ELEMENTS", 1000)
    source = tiny_gpt(quant_config, torch.float32 if kind.startswith("fp32") else torch.bfloat16)
    path = write_checkpoint(source.state_dict(), kind.removeprefix("fp32-"), tmp_path)

    model, report = quant_load(path, quantize=scheme)
    whole_reads = set(read_recorder.whole)
    ref = quantize_after_load(quant_load(path)[0], scheme)
    assert_same_weights(model, ref)
    torch.testing.assert_close(forward_logits(model), forward_logits(ref), rtol=0, atol=0)
    quantized_weights = {f"{name}.weight" for name in report.quantized}
    assert quantized_weights and not quantized_weights & whole_reads  # none of them was read whole
    fc = "transformer.h.0.mlp.fc.weight"  # 256 x 128: blocks of 7 rows, the last one of 4 (read by two threads)
    assert sorted((a, b) for key, a, b in read_recorder.rows if key == fc) == [(a, min(a + 7, 256))
                                                                               for a in range(0, 256, 7)]
    assert {key for key, _, _ in read_recorder.rows} == quantized_weights
    assert report.quantized_bytes_before == sum(2 * model.get_submodule(n).in_features
                                                * model.get_submodule(n).out_features for n in report.quantized)


def test_file_cut_short_while_a_weight_is_read_by_rows(tmp_path, monkeypatch, quant_config, tiny_gpt, meta_gpt,
                                                       read_recorder):
    """The file shrinks half-way through a weight read by rows: a typed error, and nothing left loaded."""
    import os

    monkeypatch.setattr(rows, "CHUNK_ELEMENTS", 1000)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_gpt(quant_config, torch.bfloat16).state_dict().items()}, path)

    def cut_in_the_second_weight(key, start, stop):
        calls = [k for k, _, _ in read_recorder.rows]
        if len(set(calls)) == 2 and calls[-3] == key:  # 3rd block of the 2nd weight: the file now ends in it
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                begin, end = json.loads(f.read(size))[key]["data_offsets"]
            os.truncate(path, 8 + size + (begin + end) // 2)

    read_recorder.before_rows = cut_in_the_second_weight
    model = meta_gpt(quant_config)
    with pytest.raises(CheckpointFormatError, match=r"changed \(size \d+ -> \d+ bytes") as error:
        load_checkpoint(model, path, dtype=torch.bfloat16, quantize="bnb.nf4", progress=False)
    calls = [k for k, _, _ in read_recorder.rows]
    assert str(path) in str(error.value) and repr(calls[-1]) in str(error.value)
    assert len(set(calls)) == 2  # it failed in that weight, after quantizing another
    assert all(t.is_meta for t in model.state_dict().values())
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("scheme", [s for s in ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.int8", "torchao.int8wo",
                                                "torchao.int8dq", "torchao.nf4"] if s in ON_CPU])
def test_whole_weights_are_the_bytes_of_blocks_of_rows(monkeypatch, scheme, quant_checkpoint, quant_load,
                                                       assert_same_weights, forward_logits):
    """On a device a weight is quantized whole (``rows.by_blocks``): with the CPU's own kernels, whole weights give
    the bytes blocks of rows give (blocks of 1000 elements here, so that every weight has several)."""
    monkeypatch.setattr(rows, "CHUNK_ELEMENTS", 1000)
    blocks, _ = quant_load(quant_checkpoint, quantize=scheme)
    calls: list[tuple[int, ...]] = []
    real = rows.RowSource.whole

    def whole(self):
        calls.append(self.shape)
        return real(self)

    monkeypatch.setattr(rows, "by_blocks", lambda device: False)
    monkeypatch.setattr(rows.RowSource, "whole", whole)
    model, report = quant_load(quant_checkpoint, quantize=scheme)
    assert report.quantized and calls  # quantized whole
    assert_same_weights(model, blocks)
    torch.testing.assert_close(forward_logits(model), forward_logits(blocks), rtol=0, atol=0)
