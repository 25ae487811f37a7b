"""One load decided from headers: the placement plan is the decision load_checkpoint makes with the same options."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem import load_checkpoint, placement_plan
from lightning_lowmem.quantize import BnbNF4


@pytest.mark.parametrize("quantize", [None, "bnb.int8", "bnb.nf4", "torchao.int8wo"])
def test_placement_weights_equal_the_bytes_the_load_holds(tmp_path, litgpt_model, write_checkpoint, meta_gpt,
                                                          quantize):
    """The plan is sized from headers alone; the load then holds exactly that many bytes (bf16 or quantized)."""
    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    plan = placement_plan(meta_gpt(litgpt_model.config), path, {"cpu": "1GiB"}, quantize=quantize,
                          dtype=torch.bfloat16)
    report = load_checkpoint(meta_gpt(litgpt_model.config), path, quantize=quantize, dtype=torch.bfloat16)
    assert report.bytes_loaded > 0 and bool(report.quantized) == (quantize is not None)
    assert sum(plan.weights_per_device().values()) == report.bytes_loaded


def test_scheme_object_with_a_budget(tmp_path, litgpt_model, write_checkpoint, meta_gpt):
    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    model = meta_gpt(litgpt_model.config)
    report = load_checkpoint(model, path, quantize=BnbNF4(blocksize=128), max_memory={"cpu": "1GiB"})
    assert report.quantized and set(report.quantized.values()) == {"bnb.nf4"}
    assert model.transformer.h[0].attn.qkv.weight.quant_state.blocksize == 128


def test_one_string_is_one_skip_pattern_in_the_placement_plan(tmp_path, litgpt_model, write_checkpoint, meta_gpt):
    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    plan = placement_plan(meta_gpt(litgpt_model.config), path, {"cpu": "1GiB"}, quantize="bnb.int8",
                          skip_quantize="lm_head")
    head = next(layer for layer in plan.layers if layer.name.startswith("lm_head"))
    assert head.nbytes == sum(p.nbytes for p in litgpt_model.lm_head.parameters())
