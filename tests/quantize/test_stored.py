"""Which weights a checkpoint holds already quantized, from its headers; which scheme a module holds its weight in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_lowmem import Checkpoint, CheckpointMismatchError, UnsupportedQuantizationError, init_empty
from lightning_lowmem.formats import TensorRecord
from lightning_lowmem.plan import make_plan
from lightning_lowmem.quantize import BnbNF4DQ, find_stored, mark_stored, scheme_of


@pytest.mark.parametrize(("scheme", "roles"), [
    ("bnb.nf4", ["weight", "absmax", "quant_map", "quant_state"]),
    ("bnb.fp4-dq", ["weight", "absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state"]),
    ("bnb.int8", ["weight", "SCB", "weight_format"]),
    ("torchao.int8dq", ["qdata", "zero_point", "scale"]),
])
def test_stored_weights_are_found_from_the_headers(hf_prequantized, scheme, roles):
    with Checkpoint.open(hf_prequantized(scheme)) as ckpt:
        stored = find_stored(ckpt.records, ckpt.metadata, ckpt.read, files=ckpt.description)
    weight = stored.weights["model.layers.0.mlp.down_proj.weight"]
    assert len(stored) == 14 and stored.schemes == [scheme]
    assert list(weight.roles) == roles and weight.scheme.name == scheme
    assert (weight.shape, weight.dtype) == ((128, 256), torch.float32 if scheme == "bnb.int8" else torch.bfloat16)
    logical = stored.logical_records(ckpt.records)
    assert logical["model.layers.0.mlp.down_proj.weight"].shape == (128, 256)
    assert not any(".absmax" in k or "_weight_" in k or k.endswith("SCB") for k in logical)


def test_a_torchao_subclass_no_scheme_reads_is_named():
    metadata = {"tensor_names": json.dumps(["l.weight"]),
                "l.weight": json.dumps({"_type": "Float8Tensor", "_data": {}, "_tensor_data_names": ["qdata"]})}
    records = {"l._weight_qdata": TensorRecord("l._weight_qdata", (4, 4), torch.float8_e4m3fn, Path("m.safetensors"))}
    with pytest.raises(UnsupportedQuantizationError, match="'l.weight' as a torchao 'Float8Tensor'.*Int8Tensor"):
        find_stored(records, metadata, None)


def test_a_stored_weight_must_go_to_a_linear(hf_prequantized):
    with Checkpoint.open(hf_prequantized("bnb.nf4-dq")) as ckpt:
        stored = find_stored(ckpt.records, ckpt.metadata, ckpt.read)
    with init_empty():
        module = nn.Module()
        module.w = nn.Linear(256, 128)
        module.p = nn.Module()
        module.p.weight = nn.Parameter(torch.empty(128, 256))
    key = "model.layers.0.mlp.down_proj.weight"
    one = type(stored)({key: stored.weights[key]})
    plan = make_plan(module, {}, key_map=lambda k: "w.weight", stored=one.weights)
    selection = mark_stored(module, plan, one)
    assert selection.chosen == {"w": "w.weight"} and selection.stored == {"w"} and plan.targets[0].scheme == BnbNF4DQ()
    assert plan.target_of("w.weight").parts == stored.weights[key].parts
    plan = make_plan(module, {}, key_map=lambda k: "p.weight", stored=one.weights)
    with pytest.raises(CheckpointMismatchError, match="goes to 'p.weight', a Module's 'weight'"):
        mark_stored(module, plan, one)


def test_scheme_of_names_each_modules_scheme(quant_checkpoint, quant_load):
    for scheme in ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4-dq", "bnb.int8", "torchao.int8wo", "torchao.int8dq"]:
        model, _ = quant_load(quant_checkpoint, quantize=scheme, progress=False)
        assert scheme_of(model.transformer.h[0].attn.qkv).name == scheme
        assert scheme_of(model.lm_head) is None and scheme_of(model.transformer.wte) is None
