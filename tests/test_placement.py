"""Placement plans: layers grouped without splitting a block, budgets kept, too-small budgets refused early."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

from lightning_lowmem import (
    Checkpoint,
    MemoryBudgetError,
    UnsupportedQuantizationError,
    init_empty,
    load_checkpoint,
    placement_plan,
)
from lightning_lowmem.placement import parse_max_memory
from lightning_lowmem.quantize import make_scheme

litgpt = pytest.importorskip("litgpt")


def tiny_config(n_layer: int = 3) -> litgpt.Config:
    return litgpt.Config(n_layer=n_layer, n_embd=32, n_head=4, block_size=64, padded_vocab_size=256,
                         vocab_size=256, intermediate_size=64, bias=True)


def meta_gpt(n_layer: int = 3) -> nn.Module:
    with init_empty():
        return litgpt.GPT(tiny_config(n_layer))


def model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


class TiedLM(nn.Module):
    """An input embedding tied to the output head, with blocks in between."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)) for _ in range(2))
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight


def test_blocks_are_never_split_and_other_modules_are_top_level():
    model = meta_gpt()
    plan = placement_plan(model, None, {"cpu": "1GiB"})
    names = [layer.name for layer in plan.layers]
    assert names == ["lm_head", "transformer.wte", "transformer.h.0", "transformer.h.1", "transformer.h.2",
                     "transformer.ln_f"]
    for layer in plan.layers:
        assert all(t.startswith(layer.name + ".") for t in layer.tensors)
    block_tensors = [n for n in model.state_dict() if n.startswith("transformer.h.1.")]
    assert sorted(plan.layers[3].tensors) == sorted(block_tensors)
    assert sum(layer.nbytes for layer in plan.layers) == model_bytes(model)


def test_tied_modules_form_one_layer():
    with init_empty():
        model = TiedLM()
    plan = placement_plan(model, None, {"cuda:0": 9000, "cpu": "1GiB"})
    tied = [layer for layer in plan.layers if "embed" in layer.name]
    assert len(tied) == 1 and sorted(tied[0].modules) == ["embed", "head"]
    assert plan.device_of("embed.weight") == plan.device_of("head.weight")


def test_overflow_goes_to_cpu_and_every_device_stays_within_budget():
    model = meta_gpt(n_layer=6)
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


def test_kv_cache_reservation_is_what_setup_kv_cache_allocates():
    from lightning_lowmem import setup_kv_cache

    plan = placement_plan(meta_gpt(), None, {"cuda:0": "1GiB", "cpu": "1GiB"}, context=48, batch_size=2,
                          dtype=torch.bfloat16)
    model = litgpt.GPT(tiny_config()).to(torch.bfloat16)
    assert plan.cache_bytes == setup_kv_cache(model, 2, 48) > 0


_MODEL_6 = meta_gpt(n_layer=6)


@settings(max_examples=60, deadline=None, database=None)
@given(budget=st.integers(1_000, 400_000), context=st.integers(1, 64), cpu=st.integers(50_000, 400_000))
def test_plan_never_exceeds_a_budget(budget: int, context: int, cpu: int):
    model = _MODEL_6
    try:
        plan = placement_plan(model, None, {"cuda:0": budget, "cpu": cpu}, context=context)
    except MemoryBudgetError as e:
        assert e.needed > e.available
        return
    used = plan.used_per_device()
    assert used["cuda:0"] <= budget and used["cpu"] <= cpu
    assert all(layer.device in ("cuda:0", "cpu") for layer in plan.layers)


def test_budget_too_small_for_one_layer_fails_before_any_weight_is_read(tmp_path, monkeypatch):
    source = litgpt.GPT(tiny_config())
    path = tmp_path / "model.safetensors"
    save_file(source.state_dict(), path)
    reads = []
    original = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, key: reads.append(key) or original(self, key))
    model = meta_gpt()
    with pytest.raises(MemoryBudgetError) as info:
        load_checkpoint(model, path, max_memory={"cuda:0": "20KiB", "cpu": "1GiB"}, context=64)
    err = info.value
    assert err.available == 20 * 1024 and err.needed > err.available
    assert str(err.needed) in str(err) and str(err.available) in str(err)
    assert "cuda:0" in str(err) and "transformer.h" in str(err)
    assert reads == []
    assert all(p.is_meta for p in model.parameters())


def test_model_too_big_for_all_budgets_fails_with_needed_and_available():
    model = meta_gpt(n_layer=6)
    total = model_bytes(model)
    with pytest.raises(MemoryBudgetError) as info:
        placement_plan(model, None, {"cuda:0": total // 3, "cpu": total // 3})
    assert info.value.needed > info.value.available
    assert info.value.available in (total // 3, 2 * (total // 3))  # the device(s) over budget
    assert str(info.value.needed) in str(info.value)
    with pytest.raises(MemoryBudgetError, match="add 'cpu'"):
        placement_plan(model, None, {"cuda:0": total // 2})


def test_quantized_bytes_match_bitsandbytes_storage():
    bnb = pytest.importorskip("bitsandbytes")
    w = torch.randn(96, 160, dtype=torch.bfloat16)
    for quant_type in ("nf4", "fp4"):
        for double in (False, True):
            codes, state = bnb.functional.quantize_4bit(w, blocksize=64, quant_type=quant_type,
                                                        compress_statistics=double)
            stored = codes.nbytes + state.absmax.nbytes + state.code.nbytes  # the code table is per weight
            if double:  # uint8 absmax, their own fp32 absmax and code table, and an fp32 offset
                stored += state.state2.absmax.nbytes + state.state2.code.nbytes + 4
            assert make_scheme(f"bnb.{quant_type}" + ("-dq" if double else "")).stored_nbytes((96, 160)) == stored
    codes, scales, _ = bnb.functional.int8_vectorwise_quant(w)
    assert make_scheme("bnb.int8").stored_nbytes((96, 160)) == codes.nbytes + scales.nbytes


def test_quantized_plan_counts_linear_weights_at_the_scheme_size_and_skips_the_head():
    model = meta_gpt()
    full = placement_plan(model, None, {"cpu": "1GiB"}, dtype=torch.bfloat16)
    q = placement_plan(model, None, {"cpu": "1GiB"}, dtype=torch.bfloat16, quantize="bnb.int8")
    by_name = {layer.name: layer.nbytes for layer in q.layers}
    assert by_name["lm_head"] == {layer.name: layer.nbytes for layer in full.layers}["lm_head"]
    block = model.transformer.h[0]
    linears = [m for m in block.modules() if type(m) is nn.Linear]
    expected = sum(make_scheme("bnb.int8").stored_nbytes((m.out_features, m.in_features)) for m in linears)
    expected += sum(t.numel() * 2 for n, t in block.state_dict().items()
                    if not any(n == f"{name}.weight" for name, m in block.named_modules() if type(m) is nn.Linear))
    assert by_name["transformer.h.0"] == expected
    with pytest.raises(UnsupportedQuantizationError, match=r"Unknown quantization scheme 'bnb\.int3'\. Known schemes: 'bnb\.nf4'"):
        placement_plan(model, None, {"cpu": "1GiB"}, quantize="bnb.int3")


def test_plan_is_printable_with_devices_layers_and_bytes():
    model = meta_gpt(n_layer=6)
    plan = placement_plan(model, None, {"cuda:0": model_bytes(model) // 2, "cpu": "1GiB"}, context=16)
    text = str(plan)
    assert "cuda:0" in text and "cpu" in text and "lm_head" in text
    assert re.search(r"transformer\.h\.\d+-\d+\s+\d+ x ", text)  # runs of equal blocks are folded
    for device in ("cuda:0", "cpu"):
        assert any(line.strip().startswith(device) for line in text.splitlines())


def test_max_memory_spellings():
    parsed = parse_max_memory({"cpu": "2GiB", 0: "1GiB"})
    assert list(parsed.bytes) == ["cuda:0", "cpu"] and parsed.bytes["cuda:0"] == 2**30
    assert (parsed.execution_device, parsed.offload_device) == ("cuda:0", "cpu")
    parsed = parse_max_memory({"cpu": 100})
    assert (parsed.bytes, parsed.execution_device, parsed.offload_device) == ({"cpu": 100}, "cpu", None)
    with pytest.raises(ValueError, match="accelerators"):
        parse_max_memory({"cuda:0": "1GiB", "cuda:1": "1GiB"})


def test_plan_from_checkpoint_headers_equals_plan_from_the_module(tmp_path):
    source = litgpt.GPT(tiny_config())
    path = tmp_path / "model.safetensors"
    save_file(source.state_dict(), path)
    model = meta_gpt()
    roomy = placement_plan(model, None, {"cuda:0": "1GiB", "cpu": "1GiB"}, context=16)
    budget = {"cuda:0": roomy.cache_bytes + roomy.activation_bytes + model_bytes(model) // 2, "cpu": "1GiB"}
    from_file = placement_plan(model, path, budget, context=16)
    from_module = placement_plan(model, None, budget, context=16)
    assert [(x.name, x.nbytes, x.device) for x in from_file.layers] == \
        [(x.name, x.nbytes, x.device) for x in from_module.layers]


def test_load_with_a_cpu_budget_matches_a_plain_load(tmp_path):
    source = litgpt.GPT(tiny_config()).eval()
    path = tmp_path / "model.safetensors"
    save_file(source.state_dict(), path)
    model = meta_gpt().eval()
    report = load_checkpoint(model, path, max_memory={"cpu": "1GiB"}, context=16)
    assert report.placement is not None and report.offload is None
    assert "placement:" in str(report)
    idx = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        assert torch.equal(model(idx), source(idx))
    with pytest.raises(ValueError, match="not both"):
        load_checkpoint(meta_gpt(), path, device="cpu", max_memory={"cpu": "1GiB"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_load_over_budget_offloads_and_matches_resident(tmp_path):
    source = litgpt.GPT(tiny_config(n_layer=6)).eval()
    path = tmp_path / "model.safetensors"
    save_file(source.state_dict(), path)
    model = meta_gpt(n_layer=6).eval()
    budget = model_bytes(model) // 2 + 200_000
    report = load_checkpoint(model, path, max_memory={"cuda:0": budget, "cpu": "1GiB"}, context=16)
    assert report.placement.offloaded and report.offload is not None
    idx = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        expected = source.cuda()(idx.cuda())
        source.cpu()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        out = model(idx.cuda())
        peak = torch.cuda.max_memory_allocated()
    torch.testing.assert_close(out, expected)
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if p.is_cuda)
    assert resident <= report.placement.weights_per_device()["cuda:0"]
    assert start <= report.placement.weights_per_device()["cuda:0"] + expected.nbytes
    assert peak <= budget + expected.nbytes  # the reference output is the only other tensor on the device
