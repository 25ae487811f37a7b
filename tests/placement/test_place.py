"""Placement plans: budgets kept, overflow to the CPU, too-small budgets refused early, bytes counted as loaded."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_lowmem import (
    MemoryBudgetError,
    UnsupportedQuantizationError,
    init_empty,
    load_checkpoint,
    placement_plan,
)
from lightning_lowmem.quantize import module_nbytes


def model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


@pytest.fixture(scope="module")
def model_6(tiny_config, meta_gpt):
    """The tiny GPT with 6 layers, on meta."""
    return meta_gpt(tiny_config(n_layer=6))


def test_overflow_goes_to_cpu_and_every_device_stays_within_budget(model_6):
    model = model_6
    total = model_bytes(model)
    roomy = placement_plan(model, None, {"cuda:0": "1GiB", "cpu": "1GiB"}, context=32)
    budget = roomy.cache_bytes + roomy.activation_bytes + total // 2
    plan = placement_plan(model, None, {"cuda:0": budget, "cpu": "1GiB"}, context=32)
    weights, used = plan.weights_per_device(), plan.used_per_device()
    assert weights["cpu"] > 0 and weights["cuda:0"] > 0
    assert weights["cuda:0"] + weights["cpu"] == total
    assert used["cuda:0"] <= budget and used["cpu"] <= 2**30
    assert plan.cache_bytes > 0 and plan.activation_bytes > 0 and plan.stream_buffers in (1, 2)
    # the room kept for streaming covers the largest layer that has to come in
    assert plan.stream_bytes >= max(layer.nbytes for layer in plan.offloaded)


def test_kv_cache_reservation_is_what_setup_kv_cache_allocates(tiny_config, meta_gpt, tiny_gpt):
    from lightning_lowmem import setup_kv_cache

    config = tiny_config(n_layer=3)
    plan = placement_plan(meta_gpt(config), None, {"cuda:0": "1GiB", "cpu": "1GiB"}, context=48, batch_size=2,
                          dtype=torch.bfloat16)
    model = tiny_gpt(config, torch.bfloat16).to(torch.bfloat16)  # RoPE tables in bf16, as a load in bf16 leaves them
    assert plan.cache_bytes == setup_kv_cache(model, 2, 48) > 0


@settings(max_examples=60, deadline=None, database=None)
@given(budget=st.integers(1_000, 400_000), context=st.integers(1, 64), cpu=st.integers(50_000, 400_000))
def test_plan_never_exceeds_a_budget(model_6, budget: int, context: int, cpu: int):
    try:
        plan = placement_plan(model_6, None, {"cuda:0": budget, "cpu": cpu}, context=context)
    except MemoryBudgetError as e:
        assert e.needed > e.available
        return
    used = plan.used_per_device()
    assert used["cuda:0"] <= budget and used["cpu"] <= cpu
    assert all(layer.device in ("cuda:0", "cpu") for layer in plan.layers)


def test_budget_too_small_for_one_layer_fails_before_any_weight_is_read(tmp_path, tiny_config, tiny_gpt, meta_gpt,
                                                                       write_checkpoint, read_recorder):
    config = tiny_config(n_layer=3)
    path = write_checkpoint(tiny_gpt(config).state_dict(), "safetensors", tmp_path)
    model = meta_gpt(config)
    with pytest.raises(MemoryBudgetError) as info:
        load_checkpoint(model, path, max_memory={"cuda:0": "20KiB", "cpu": "1GiB"}, context=64)
    err = info.value
    assert err.available == 20 * 1024 and err.needed > err.available
    assert str(err.needed) in str(err) and str(err.available) in str(err)
    assert "cuda:0" in str(err) and "transformer.h" in str(err)
    assert read_recorder.keys == []
    assert all(p.is_meta for p in model.parameters())


def test_model_too_big_for_all_budgets_fails_with_needed_and_available(model_6):
    model = model_6
    total = model_bytes(model)
    with pytest.raises(MemoryBudgetError) as info:
        placement_plan(model, None, {"cuda:0": total // 3, "cpu": total // 3})
    assert info.value.needed > info.value.available
    assert info.value.available in (total // 3, 2 * (total // 3))  # the device(s) over budget
    assert str(info.value.needed) in str(info.value)
    with pytest.raises(MemoryBudgetError, match="add 'cpu'"):
        placement_plan(model, None, {"cuda:0": total // 2})


def test_quantized_plan_counts_each_layer_as_the_loader_holds_it_and_skips_the_head(tmp_path, tiny_config, tiny_gpt,
                                                                                   meta_gpt, write_checkpoint):
    config = tiny_config(n_layer=3)
    model = meta_gpt(config)
    full = placement_plan(model, None, {"cpu": "1GiB"}, dtype=torch.bfloat16)
    q = placement_plan(model, None, {"cpu": "1GiB"}, dtype=torch.bfloat16, quantize="bnb.int8")
    by_name = {layer.name: layer.nbytes for layer in q.layers}
    assert by_name["lm_head"] == {layer.name: layer.nbytes for layer in full.layers}["lm_head"]
    assert by_name["transformer.h.0"] < {layer.name: layer.nbytes for layer in full.layers}["transformer.h.0"]
    loaded = meta_gpt(config)  # what the loader holds, layer by layer
    load_checkpoint(loaded, write_checkpoint(tiny_gpt(config).state_dict(), "safetensors", tmp_path),
                    dtype=torch.bfloat16, quantize="bnb.int8")
    assert by_name == {name: module_nbytes(loaded.get_submodule(name)) for name in by_name}
    with pytest.raises(UnsupportedQuantizationError, match=r"Unknown quantization scheme 'bnb\.int3'\..*Known schemes: 'bnb\.nf4'"):
        placement_plan(model, None, {"cpu": "1GiB"}, quantize="bnb.int3")


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


def test_plan_is_printable_with_devices_layers_and_bytes(model_6):
    model = model_6
    plan = placement_plan(model, None, {"cuda:0": model_bytes(model) // 2, "cpu": "1GiB"}, context=16)
    text = str(plan)
    assert "cuda:0" in text and "cpu" in text and "lm_head" in text
    assert re.search(r"transformer\.h\.\d+-\d+\s+\d+ x ", text)  # runs of equal blocks are folded
    for device in ("cuda:0", "cpu"):
        assert any(line.strip().startswith(device) for line in text.splitlines())


def test_plan_from_checkpoint_headers_equals_plan_from_the_module(tmp_path, tiny_config, tiny_gpt, meta_gpt,
                                                                  write_checkpoint):
    config = tiny_config(n_layer=3)
    path = write_checkpoint(tiny_gpt(config).state_dict(), "safetensors", tmp_path)
    model = meta_gpt(config)
    roomy = placement_plan(model, None, {"cuda:0": "1GiB", "cpu": "1GiB"}, context=16)
    budget = {"cuda:0": roomy.cache_bytes + roomy.activation_bytes + model_bytes(model) // 2, "cpu": "1GiB"}
    from_file = placement_plan(model, path, budget, context=16)
    from_module = placement_plan(model, None, budget, context=16)
    assert [(x.name, x.nbytes, x.device) for x in from_file.layers] == \
        [(x.name, x.nbytes, x.device) for x in from_module.layers]


def test_a_model_too_big_for_its_budget_is_refused_naming_disk_offload_which_leaves_the_rest_on_disk(model_6):
    total = model_bytes(model_6)
    with pytest.raises(MemoryBudgetError, match=r"disk_offload=True"):
        placement_plan(model_6, None, {"cpu": total // 5})
    with pytest.raises(MemoryBudgetError, match=r"disk_offload=True"):  # smaller than one layer
        placement_plan(model_6, None, {"cpu": 4096})

    plan = placement_plan(model_6, None, {"cpu": total // 5}, disk_offload=True)
    weights = plan.weights_per_device()
    assert weights["cpu"] + weights["disk"] == total and plan.used_per_device()["cpu"] <= total // 5
    assert len(plan.on_disk) >= 4 and {layer.device for layer in plan.layers} == {"cpu", "disk"}
    assert plan.disk_read_bytes == sum(layer.read_nbytes for layer in plan.on_disk) == weights["disk"]
    # two read buffers of the largest layer on disk, each a block of whole pages (its tensors 64-byte aligned)
    assert plan.disk_buffer_bytes == 2 * max(layer.buffer_nbytes for layer in plan.on_disk)
    assert max(layer.buffer_nbytes for layer in plan.on_disk) - max(layer.nbytes for layer in plan.on_disk) < 2 * 4096
    assert plan.stream_bytes == 0  # on the CPU a layer runs from its read buffer: nothing else is reserved
    assert plan.seconds_per_token() is None and plan.seconds_per_token(plan.disk_read_bytes / 2) == 2.0
    assert plan.device_of(plan.on_disk[0].tensors[0]) == torch.device("cpu")
    assert plan.to_dict()["disk"]["read_bytes_per_forward"] == plan.disk_read_bytes
    assert "read from the checkpoint file for each forward" in str(plan) and " disk" in str(plan)

    roomy = placement_plan(model_6, None, {"cpu": "1GiB"}, disk_offload=True)
    assert not roomy.on_disk and roomy.disk_buffer_bytes == 0 and roomy.seconds_per_token() == 0.0


@settings(max_examples=60, deadline=None, database=None)
@given(budget=st.integers(1_000, 400_000), context=st.integers(1, 64), cpu=st.integers(0, 400_000))
def test_with_the_disk_tier_every_budget_holds_and_the_device_has_room_for_what_visits_it(model_6, budget: int,
                                                                                       context: int, cpu: int):
    try:
        plan = placement_plan(model_6, None, {"cuda:0": budget, "cpu": cpu}, context=context, disk_offload=True)
    except MemoryBudgetError as e:  # only when the device cannot run its largest layer
        assert "cannot hold one layer" in str(e) and e.needed > e.available
        return
    used = plan.used_per_device()
    assert used["cuda:0"] <= budget and used["cpu"] <= cpu
    visiting = [layer.nbytes for layer in plan.layers if layer.device != "cuda:0"]
    assert plan.stream_bytes >= max(visiting, default=0)  # CPU and disk layers both visit the device
    assert sum(plan.weights_per_device().values()) == model_bytes(model_6)
