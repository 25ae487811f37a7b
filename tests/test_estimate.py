"""estimate_memory: from headers or a config, equal to what is allocated, and within 5% of a measured peak."""

from __future__ import annotations

import pytest
import torch
from gen_helpers import (
    kv_formula,
    measure_in_fresh_process,
    peak_model,
    tiny_config,
    tiny_gpt,
    write_hf_dir,
    write_litgpt_dir,
)

from lightning_lowmem import (
    UnsupportedQuantizationError,
    cache_bytes,
    estimate_memory,
    init_empty,
    load_checkpoint,
    setup_kv_cache,
)
from lightning_lowmem.engine import LOAD_RUNTIME
from lightning_lowmem.quantize import make_scheme

SHAPES = [(96, 64), (100, 72), (33, 130)]  # block multiples and not


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.fp4", "bnb.nf4-dq", "bnb.fp4-dq"])
def test_bnb_4bit_formula_equals_what_bitsandbytes_stores(scheme, shape):
    import bitsandbytes.functional as F

    weight = torch.randn(shape, dtype=torch.bfloat16)
    double = scheme.endswith("-dq")
    codes, state = F.quantize_4bit(weight, quant_type=scheme[4:7], blocksize=64, compress_statistics=double)
    stored = [codes, state.absmax, state.code] + ([state.state2.absmax, state.offset, state.state2.code]
                                                  if double else [])
    assert make_scheme(scheme).stored_nbytes(tuple(shape)) == sum(t.numel() * t.element_size() for t in stored)


@pytest.mark.parametrize("shape", SHAPES)
def test_bnb_int8_formula_equals_what_bitsandbytes_stores(shape):
    import bitsandbytes.functional as F

    codes, row_scales, _ = F.int8_vectorwise_quant(torch.randn(shape, dtype=torch.float16))
    assert make_scheme("bnb.int8").stored_nbytes(tuple(shape)) == codes.numel() + row_scales.numel() * row_scales.element_size()


@pytest.mark.parametrize("scheme", ["torchao.int8wo", "torchao.int8dq"])
def test_torchao_int8_formula_equals_what_torchao_stores(scheme):
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    linear = torch.nn.Sequential(torch.nn.Linear(72, 100, bias=False, dtype=torch.bfloat16))
    quantize_(linear, Int8WeightOnlyConfig() if scheme.endswith("wo") else Int8DynamicActivationInt8WeightConfig())
    inner = linear[0].weight
    names, _ = inner.__tensor_flatten__()
    assert make_scheme(scheme).stored_nbytes((100, 72)) == sum(getattr(inner, n).numel() * getattr(inner, n).element_size()
                                                       for n in names)


def test_unknown_scheme():
    with pytest.raises(UnsupportedQuantizationError, match="bnb.nf5"):
        estimate_memory(tiny_config("gqa"), quantize="bnb.nf5")


@pytest.mark.parametrize("kind", ["pythia", "gqa", "sliding"])
@pytest.mark.parametrize("batch", [1, 2])
def test_caches_equal_what_setup_kv_cache_allocates(kind, batch):
    config = tiny_config(kind)
    est = estimate_memory(config, batch_size=batch, max_seq_length=30, prompt_length=10)
    model = tiny_gpt(config, torch.bfloat16)
    assert setup_kv_cache(model, batch, 30) == est.caches
    held = cache_bytes(model)
    assert (est.kv_cache, est.mask, est.rope) == (held.kv, held.mask, held.rope)
    assert est.kv_cache == kv_formula(config, batch, 30, 2)


def test_weights_from_headers_equal_the_loaded_model(tmp_path):
    config = tiny_config("gqa")
    directory = write_litgpt_dir(tmp_path / "fp32", config, torch.float32, tokenizer=False)
    est = estimate_memory(directory, dtype=torch.bfloat16, max_seq_length=16)
    from litgpt import GPT

    with init_empty(include_buffers=True):
        model = GPT(config)
    load_checkpoint(model, directory / "lit_model.pth", dtype=torch.bfloat16)
    assert est.weights == sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    assert est.load_transient == largest * 4 + LOAD_RUNTIME  # the fp32 tensor as read, beside its bf16 copy
    assert est.weights == estimate_memory(config, max_seq_length=16).weights  # headers == config


def test_quantized_weights_use_the_scheme_for_linear_layers_but_not_the_head():
    config = tiny_config("gqa")
    est = estimate_memory(config, quantize="bnb.nf4", max_seq_length=16)
    model = tiny_gpt(config)
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    quantized = sum(make_scheme("bnb.nf4").stored_nbytes(tuple(m.weight.shape)) for m in linears)
    rest = sum(p.numel() for p in model.parameters()) - sum(m.weight.numel() for m in linears)
    assert est.quantized_weights == quantized and est.weights == quantized + rest * 2
    assert est.quantized_params == sum(m.weight.numel() for m in linears)


@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4-dq", "bnb.int8", "torchao.int8wo",
                                    "torchao.int8dq"])
def test_quantized_weights_equal_what_the_loader_holds(tmp_path, scheme):
    from litgpt import GPT

    from lightning_lowmem.quantize import module_nbytes

    config = tiny_config("gqa", n_embd=128, intermediate_size=256)
    torch.save(tiny_gpt(config).state_dict(), tmp_path / "lit_model.pth")
    with init_empty(include_buffers=True):
        model = GPT(config)
    report = load_checkpoint(model, tmp_path / "lit_model.pth", dtype=torch.bfloat16, quantize=scheme)
    est = estimate_memory(tmp_path / "lit_model.pth", config=config, quantize=scheme, max_seq_length=16)
    assert est.quantized_weights == report.quantized_bytes_after
    assert est.weights == module_nbytes(model) == report.bytes_loaded
    assert len(report.quantized) == est_linears(config) == 10  # attn.qkv, attn.proj, mlp.fc_1/fc_2/proj x 2


def est_linears(config) -> int:
    model = tiny_gpt(config)
    return sum(isinstance(m, torch.nn.Linear) and n != "lm_head" for n, m in model.named_modules())


def test_hf_headers_through_litgpts_key_conversion(tmp_path):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, rotary_pct=0.25, tie_word_embeddings=False)
                       ).save_pretrained(tmp_path / "neox")
    config = tiny_config("pythia", vocab_size=128)
    from_hf = estimate_memory(tmp_path / "neox", config=config, quantize="bnb.nf4", max_seq_length=20)
    assert from_hf.params == estimate_memory(config, max_seq_length=20).params
    assert from_hf.weights == estimate_memory(config, quantize="bnb.nf4", max_seq_length=20).weights


@pytest.mark.parametrize("tie", [False, True], ids=["lm_head", "tied"])
def test_hf_fused_qkv_headers_equal_what_the_load_holds(tmp_path, tie):
    """q, k and v fused into qkv (sizes from the headers); a head the checkpoint lacks is the embedding, held once."""
    from lightning_lowmem.litgpt.generation import load_for_generation

    _, config = write_hf_dir(tmp_path / "llama", "llama-gqa", hidden=64, tie=tie, tokenizer=False)
    _, _, report = load_for_generation(tmp_path / "llama", quantize="bnb.nf4", precision="bf16-true")
    est = estimate_memory(tmp_path / "llama", quantize="bnb.nf4", max_seq_length=20)
    assert est.quantized_weights == report.quantized_bytes_after and est.weights == report.bytes_loaded
    untied = estimate_memory(config, quantize="bnb.nf4", max_seq_length=20)
    assert est.params == untied.params - (config.padded_vocab_size * config.n_embd if tie else 0)


def test_without_a_config_weights_only_and_a_note(tmp_path):
    torch.save(tiny_gpt(tiny_config("gqa")).state_dict(), tmp_path / "model.pt")
    est = estimate_memory(tmp_path / "model.pt")
    assert est.weights > 0 and est.kv_cache == 0 and "not estimated" in str(est)


def test_past_the_block_size_and_the_table():
    with pytest.raises(ValueError, match="block size"):
        estimate_memory(tiny_config("gqa"), max_seq_length=65)
    table = str(estimate_memory(tiny_config("gqa"), max_seq_length=40, prompt_length=8))
    for label in ("weights", "KV cache (1 x 40 positions)", "mask", "RoPE", "load transient", "peak"):
        assert label in table



def test_estimate_within_5_percent_of_the_measured_peak(tmp_path_factory):
    """A 45M-parameter bf16 model (87 MiB), 64 + 50 tokens, lightning_lowmem.generate() in a fresh process."""
    directory = peak_model(tmp_path_factory.getbasetemp())
    measured = measure_in_fresh_process(directory, "entry-point")["model_peak"]
    est = estimate_memory(directory, max_seq_length=114, prompt_length=64)
    assert abs(measured - est.peak) <= 0.05 * measured, (measured, str(est))


def test_estimate_carries_the_placement_plan():
    """With max_memory the estimate prints where each layer goes, the same plan a load would use."""
    from litgpt import Config

    from lightning_lowmem import MemoryBudgetError, init_empty, placement_plan

    config = Config.from_name("pythia-160m")
    budget = {"cuda:0": "150MiB", "cpu": "4GiB"}
    est = estimate_memory(config, max_memory=budget, max_seq_length=128)
    assert est.placement is not None and est.placement.offloaded
    from litgpt import GPT

    with init_empty():
        model = GPT(config)
    direct = placement_plan(model, None, budget, context=128, dtype=torch.bfloat16)
    assert est.placement.weights_per_device() == direct.weights_per_device()
    assert "cuda:0" in str(est) and "cpu" in str(est)
    with pytest.raises(MemoryBudgetError):
        estimate_memory(config, max_memory={"cuda:0": "1MiB", "cpu": "4GiB"}, max_seq_length=128)
