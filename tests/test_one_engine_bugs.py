"""The five disagreements between the faces, each written against the public API."""

from __future__ import annotations

import sys

import lightning as L
import pytest
import torch
from conftest import tiny_litgpt_config, write_checkpoint
from torch import nn

from lightning_lowmem import LowMemStrategy, estimate_memory, init_empty, load_checkpoint, placement_plan
from lightning_lowmem.quantize import BnbNF4


def _meta_gpt(config):
    from litgpt import GPT

    with init_empty():
        return GPT(config)


def test_scheme_object_with_a_budget(tmp_path, litgpt_model):
    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    model = _meta_gpt(litgpt_model.config)
    report = load_checkpoint(model, path, quantize=BnbNF4(blocksize=128), max_memory={"cpu": "1GiB"})
    assert report.quantized and set(report.quantized.values()) == {"bnb.nf4"}
    assert model.transformer.h[0].attn.qkv.weight.quant_state.blocksize == 128


def test_one_string_is_one_skip_pattern(tmp_path, litgpt_model):
    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    strategy = LowMemStrategy(quantize="bnb.int8", skip_quantize="lm_head")
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    with fabric.init_module():
        from litgpt import GPT

        model = GPT(litgpt_model.config)
    fabric.load_raw(path, model)
    assert type(model.lm_head) is nn.Linear and "lm_head" not in strategy.reports[-1].quantized
    assert "transformer.h.0.attn.qkv" in strategy.reports[-1].quantized

    plan = placement_plan(_meta_gpt(litgpt_model.config), path, {"cpu": "1GiB"}, quantize="bnb.int8",
                          skip_quantize="lm_head")
    head = next(layer for layer in plan.layers if layer.name.startswith("lm_head"))
    assert head.nbytes == sum(p.nbytes for p in litgpt_model.lm_head.parameters())


@pytest.mark.parametrize("kind", ["pythia", "gqa", "sliding"])
def test_placement_and_estimate_reserve_the_same_cache_bytes(kind):
    from gen_helpers import tiny_config

    config = tiny_config(kind, block_size=256)
    est = estimate_memory(config, max_seq_length=200, dtype=torch.bfloat16)
    plan = placement_plan(_meta_gpt(config), None, {"cpu": "8GiB"}, context=200, dtype=torch.bfloat16)
    assert plan.cache_bytes == est.caches


def test_placement_counts_what_the_loader_keeps_in_full_precision():
    with init_empty():
        model = nn.Sequential(nn.Linear(100, 256))
    plan = placement_plan(model, None, {"cpu": "1GiB"}, quantize="torchao.int4wo", dtype=torch.bfloat16)
    assert sum(plan.weights_per_device().values()) == (100 * 256 + 256) * 2


def test_gpt_neox_output_head_counted_as_the_loader_keeps_it(tmp_path):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=64)
    GPTNeoXForCausalLM(config).save_pretrained(tmp_path)
    with init_empty():
        model = GPTNeoXForCausalLM(config)
    plan = placement_plan(model, tmp_path, {"cpu": "1GiB"}, quantize="bnb.int8")
    report = load_checkpoint(model, tmp_path, quantize="bnb.int8")
    assert "embed_out" not in report.quantized
    head = next(layer for layer in plan.layers if layer.name == "embed_out")
    assert head.nbytes == model.embed_out.weight.nbytes
    non_persistent = sum(b.nbytes for m in model.modules() for n, b in m._buffers.items()
                         if n in m._non_persistent_buffers_set)  # rotary inv_freq: real, and no weight
    assert sum(plan.weights_per_device().values()) == report.bytes_loaded - non_persistent


def test_fabric_load_raw_opens_the_file_once_and_plans_once(tmp_path, litgpt_model, monkeypatch):
    import lightning_lowmem.plan as plan_module

    path = write_checkpoint(litgpt_model.state_dict(), "pth", tmp_path)
    opens: list[str] = []
    plans: list[int] = []
    original = plan_module.make_plan

    def counting_plan(*args, **kwargs):
        plans.append(1)
        return original(*args, **kwargs)

    for name, mod in list(sys.modules.items()):
        if name.startswith("lightning_lowmem") and getattr(mod, "make_plan", None) is original:
            monkeypatch.setattr(mod, "make_plan", counting_plan)
    recording = [False]
    sys.addaudithook(lambda event, args: opens.append(str(args[0])) if event == "open" and recording[0] else None)
    strategy = LowMemStrategy()
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    with fabric.init_module():
        from litgpt import GPT

        model = GPT(litgpt_model.config)
    recording[0] = True
    fabric.load_raw(path, model)
    recording[0] = False
    assert opens.count(str(path)) <= 2 and len(plans) == 1


def test_fabric_load_does_not_torch_load_the_weights(tmp_path, litgpt_model, monkeypatch):
    path = tmp_path / "fabric.ckpt"
    torch.save({"model": litgpt_model.state_dict(), "step": 3}, path)
    calls = []
    original = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(kw) or original(*a, **kw))
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="lowmem")
    with fabric.init_module():
        from litgpt import GPT

        model = GPT(litgpt_model.config)
    rest = fabric.load(path, {"model": model})
    assert rest == {"step": 3}
    assert not any(kw.get("mmap") for kw in calls) and len(calls) <= 1
