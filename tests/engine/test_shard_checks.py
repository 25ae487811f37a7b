"""QLoRA's NF4 under FSDP2: built on meta before sharding, each rank quantizing whole weights and keeping its rows;
schemes that cannot be sharded refused before any read."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem import LoadOptions, UnsupportedQuantizationError, init_empty
from lightning_lowmem.engine import quantize_for_sharding
from lightning_lowmem.quantize.nf4 import NF4Linear, is_nf4


def test_nf4_modules_are_built_on_meta_before_sharding(tiny_config):
    from litgpt import GPT

    config = tiny_config(n_embd=256, intermediate_size=512, vocab_size=101, padded_vocab_size=101)
    with init_empty():
        model = GPT(config)
    selection = quantize_for_sharding(model, LoadOptions(quantize="torchao.nf4"), count=2)
    assert set(selection.chosen) == {f"transformer.h.{i}.{m}" for i in range(2)
                                     for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}
    assert "lm_head" in selection.left_out
    for name in selection.chosen:
        module = model.get_submodule(name)
        assert type(module) is NF4Linear and is_nf4(module.weight) and module.weight.is_meta
        assert not module.weight.requires_grad and module.bias.is_meta


def test_weights_that_do_not_split_stay_in_full_precision():
    with init_empty():
        model = nn.Sequential(nn.Linear(128, 384), nn.Linear(128, 256))  # 3 blocks of 16384 weights; 2 blocks
    selection = quantize_for_sharding(model, LoadOptions(quantize="torchao.nf4"), count=2)
    assert selection.left_out["0"] == "its 3 blocks of 16384 weights do not split evenly into 2 shards"
    assert list(selection.chosen) == ["1"] and type(model[0]) is nn.Linear


@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.int8", "torchao.int8wo", "torchao.int4wo"])
def test_schemes_that_cannot_be_sharded_are_refused_naming_the_one_that_can(scheme):
    with init_empty():
        model = nn.Sequential(nn.Linear(256, 128))
    with pytest.raises(UnsupportedQuantizationError, match=r"cannot be sharded.*'torchao\.nf4'"):
        quantize_for_sharding(model, LoadOptions(quantize=scheme), count=2)
    assert type(model[0]) is nn.Linear


def test_real_weights_are_refused():
    model = nn.Sequential(nn.Linear(256, 128))
    with pytest.raises(ValueError, match="already hold real weights"):
        quantize_for_sharding(model, LoadOptions(quantize="torchao.nf4"), count=2)


NF4_SHARDED = """
from litgpt import GPT
from lightning_lowmem import Checkpoint, LoadOptions, init_empty, load_checkpoint
from lightning_lowmem.engine import quantize_for_sharding
from lightning_lowmem.placement import shard_model

reads = []
for method in ("read", "read_rows"):
    real = getattr(Checkpoint, method)
    setattr(Checkpoint, method, lambda self, key, *a, _real=real, **k: reads.append(key) or _real(self, key, *a, **k))

def build(quantize=None, shard=True):
    torch.set_default_dtype(torch.bfloat16)
    with init_empty():
        model = GPT(config())
    torch.set_default_dtype(torch.float32)
    if quantize:
        quantize_for_sharding(model, LoadOptions(quantize=quantize), world)
    return shard_model(model, mesh) if shard else model

refused = {}
for scheme, model in (("bnb.nf4", build()), ("torchao.nf4", build())):  # the second: not built as NF4 first
    try:
        load_checkpoint(model, args["path"], quantize=scheme, progress=False)
    except Exception as e:
        refused[scheme] = [type(e).__name__, str(e), all(p.is_meta for p in model.parameters())]
emit(refused=refused, reads=len(reads))

model = build("torchao.nf4")
report = load_checkpoint(model, args["path"], quantize="torchao.nf4", progress=False)
single = build("torchao.nf4", shard=False)
load_checkpoint(single, args["path"], quantize="torchao.nf4", progress=False)
tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    equal = torch.equal(model(tokens), single(tokens))
emit(equal=equal, quantized=sorted(report.quantized), bytes_read=report.bytes_read,
     shard_bytes=report.shard_bytes)
"""


@pytest.mark.slow
def test_nf4_sharded_forward_equals_the_single_device_nf4_forward(run_ranks, shard_config, tiny_gpt,
                                                                   write_checkpoint, tmp_path):
    """Skewed weights (each row scaled from 0.01 to 30): NF4's scales differ widely across a weight, so a rank that
    quantized only its own rows would get other scales and another forward."""
    from litgpt import Config

    state = tiny_gpt(Config(**shard_config), torch.bfloat16, std=0.3).state_dict()
    state = {k: v * torch.linspace(0.01, 30, v.shape[0]).to(v.dtype)[:, None] if v.dim() == 2 else v
             for k, v in state.items()}
    path = write_checkpoint(state, "safetensors", tmp_path)
    ranks = run_ranks(NF4_SHARDED, dict(config=shard_config, path=str(path)), timeout=400)
    for result in ranks:
        assert result.returncode == 0, result.stderr[-3000:]
        refused = result.values["refused"]
        assert refused["bnb.nf4"][0] == "UnsupportedQuantizationError" and "'torchao.nf4'" in refused["bnb.nf4"][1]
        assert refused["torchao.nf4"][0] == "UnsupportedQuantizationError"
        assert "built before the model is sharded" in refused["torchao.nf4"][1]
        assert refused["bnb.nf4"][2] and refused["torchao.nf4"][2]  # left on meta
        assert result.values["reads"] == 0  # refused before any read
        assert result.values["equal"]
        assert len(result.values["quantized"]) == 8


STORED_SHARDED = """
from litgpt import GPT
from lightning_lowmem import Checkpoint, init_empty, load_checkpoint
from lightning_lowmem.placement import shard_model

reads = []
real = Checkpoint.read
Checkpoint.read = lambda self, key, *a, **k: reads.append(key) or real(self, key, *a, **k)
torch.set_default_dtype(torch.bfloat16)
with init_empty():
    model = GPT(config())
torch.set_default_dtype(torch.float32)
model = shard_model(model, mesh)
try:
    load_checkpoint(model, args["path"], progress=False)
    emit(error=None)
except Exception as e:
    emit(error=[type(e).__name__, str(e)], meta=all(p.is_meta for p in model.parameters()),
         quant_state_reads=[k for k in reads if "quant_state" not in k])
"""


def test_weights_stored_quantized_are_refused_by_a_sharded_model_before_any_read(run_ranks, shard_config, tiny_gpt,
                                                                                  write_checkpoint, tmp_path):
    """A pre-quantized checkpoint cannot fill DTensor shards: every rank says so, and reads no weight."""
    from litgpt import Config

    from lightning_lowmem import load_checkpoint, save_checkpoint
    from lightning_lowmem.litgpt.checkpoint_dir import build_meta_gpt

    config = Config(**shard_config)
    path = write_checkpoint(tiny_gpt(config, torch.bfloat16, std=0.3).state_dict(), "safetensors", tmp_path)
    model = build_meta_gpt(config)
    load_checkpoint(model, path, dtype=torch.bfloat16, quantize="bnb.nf4", progress=False)
    save_checkpoint(model, tmp_path / "nf4")
    for result in run_ranks(STORED_SHARDED, dict(config=shard_config, path=str(tmp_path / "nf4"))):
        assert result.returncode == 0, result.stderr[-3000:]
        kind, message = result.values["error"]
        assert kind == "UnsupportedQuantizationError" and "already quantized" in message and "torchao.nf4" in message
        assert result.values["meta"] and result.values["quant_state_reads"] == []  # only the quant states' JSON
