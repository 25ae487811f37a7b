"""generate(): same tokens as litgpt's own generate, litgpt and HF checkpoint directories, the script, the memory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lightning_lowmem import (
    CheckpointMismatchError,
    estimate_memory,
    generate,
    layer_offload,
    patch_litgpt,
    unpatch_litgpt,
)
from lightning_lowmem.litgpt.kv_cache import model_device

PROMPT = "t5 t17 t3 t99 t42 t8"


@pytest.mark.parametrize("kind", ["pythia", "gqa", "sliding"])
@pytest.mark.parametrize("precision", ["bf16-true", "32-true"])
def test_greedy_tokens_equal_litgpts_generate_with_and_without_the_patch(tmp_path, tiny_config, write_litgpt_dir,
                                                                         litgpt_cli_tokens, kind, precision):
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    directory = write_litgpt_dir(tmp_path / kind, tiny_config(kind), dtype)
    expected = litgpt_cli_tokens(directory, PROMPT, precision, 20)  # 6 + 20 positions: past the sliding window of 8

    got = generate(directory, PROMPT, max_new_tokens=20, temperature=0.0, precision=precision)
    assert got.tokens[0].tolist() == expected
    with patch_litgpt():
        assert litgpt_cli_tokens(directory, PROMPT, precision, 20) == expected
        assert generate(directory, PROMPT, max_new_tokens=20, top_k=1, precision=precision).tokens[0].tolist() \
            == expected
    unpatch_litgpt()


def test_result_has_tokens_texts_and_memory(tmp_path, tiny_config, write_litgpt_dir):
    config = tiny_config("gqa")
    directory = write_litgpt_dir(tmp_path / "gqa", config, torch.bfloat16)
    result = generate(directory, PROMPT, max_new_tokens=9, num_samples=2, temperature=0.0)
    assert result.prompt_length == 6 and len(result.tokens) == 2
    assert torch.equal(result.tokens[0], result.tokens[1])  # the second sample reuses the zeroed caches
    assert result.texts[0].split() == [f"t{i}" for i in result.new_tokens[0].tolist()]  # the reply, not the prompt
    memory = result.memory
    est = estimate_memory(directory, max_seq_length=15, prompt_length=6)  # the caches of 6 + 9 positions, in bf16
    assert (memory.kv_cache, memory.mask, memory.rope) == (est.kv_cache, est.mask, est.rope)
    assert memory.kv_cache > 0 and memory.mask > 0 and memory.rope > 0
    params = sum(t.numel() for t in torch.load(directory / "lit_model.pth").values())
    assert memory.weights == params * 2
    assert memory.peak >= memory.load_peak > 0
    assert "KV cache" in str(memory) and result.tokens_per_second > 0


def test_token_ids_without_a_tokenizer(tmp_path, tiny_config, write_litgpt_dir):
    directory = write_litgpt_dir(tmp_path / "ids", tiny_config("pythia"), tokenizer=False)
    result = generate(directory, "1 2 3", max_new_tokens=4, temperature=0.0)
    assert result.tokens[0][:3].tolist() == [1, 2, 3] and result.texts is None
    assert torch.equal(generate(directory, [1, 2, 3], max_new_tokens=4, temperature=0.0).tokens[0],
                       result.tokens[0])
    with pytest.raises(ValueError, match="token ids like '1 2 3'"):
        generate(directory, "hello world", max_new_tokens=4)


def test_a_checkpoint_missing_a_layer_is_an_error_not_a_random_layer(tmp_path, tiny_config, write_litgpt_dir):
    """The Fabric strategy initializes trainable parameters a checkpoint lacks (LoRA); generation must not."""
    directory = write_litgpt_dir(tmp_path / "cut", tiny_config("pythia"), tokenizer=False)
    state = torch.load(directory / "lit_model.pth")
    del state["transformer.h.1.attn.proj.weight"], state["transformer.h.1.attn.proj.bias"]
    torch.save(state, directory / "lit_model.pth")
    with pytest.raises(CheckpointMismatchError, match=r"transformer\.h\.1\.attn\.proj\.weight"):
        generate(directory, [1, 2, 3], max_new_tokens=2)


def test_request_past_the_block_size(tmp_path, tiny_config, write_litgpt_dir):
    directory = write_litgpt_dir(tmp_path / "b", tiny_config("pythia"), tokenizer=False)
    with pytest.raises(ValueError, match=r"70 positions.*block size.*is 64"):
        generate(directory, "1 2 3 4 5 6", max_new_tokens=64)


def _hf_neox(directory: Path, config):
    """A tiny GPT-NeoX written by transformers' save_pretrained (safetensors), with the litgpt config beside it."""
    from litgpt.utils import save_config
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    hf = GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        rotary_pct=0.25, max_position_embeddings=64, use_parallel_residual=True, tie_word_embeddings=False,
        hidden_act="gelu", layer_norm_eps=1e-5)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    hf.save_pretrained(directory, safe_serialization=True)
    save_config(config, directory)
    return hf


def test_hf_safetensors_directory_through_litgpts_key_conversion(tmp_path, tiny_config):
    from lightning_lowmem.litgpt.generation import load_for_generation

    directory = tmp_path / "neox"
    hf = _hf_neox(directory, tiny_config("pythia", vocab_size=128))
    assert (directory / "model.safetensors").is_file() and not (directory / "lit_model.pth").exists()
    model, _, report = load_for_generation(directory, precision="32-true")
    assert report.skipped == [] and report.missing == []
    ids = torch.tensor([[5, 17, 3, 99, 42, 8]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)

    result = generate(directory, ids[0], max_new_tokens=10, temperature=0.0, precision="32-true")
    expected = hf.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert result.tokens[0].tolist() == expected[0].tolist()


def test_hf_family_with_split_qkv_generates_like_litgpt_on_its_converted_checkpoint(tmp_path, write_hf_dir,
                                                                                     litgpt_converted,
                                                                                     litgpt_cli_tokens):
    """Llama-family HF directories stream in (q, k, v fused as read); see test_hf.py for the details."""
    directory = tmp_path / "llama"
    _, config = write_hf_dir(directory, "llama-gqa", tie=True)
    expected = litgpt_cli_tokens(litgpt_converted(directory, config, tmp_path / "converted"), PROMPT, "32-true", 10)
    assert generate(directory, PROMPT, max_new_tokens=10, top_k=1, precision="32-true").tokens[0].tolist() == expected


@pytest.mark.slow
def test_script_entry_point_and_patched_api_peak_together(peak_model_dir, measure_in_fresh_process):
    """Fresh processes, a 45M-parameter bf16 model, 64 + 50 tokens: one setup path, one peak."""
    directory = peak_model_dir
    entry, script, api = (measure_in_fresh_process(directory, p) for p in ("entry-point", "script", "litgpt-api-patched"))
    assert abs(script["peak"] - entry["peak"]) <= 0.02 * entry["peak"], (entry["peak"], script["peak"])
    # Fabric and litgpt's prompt handling add a few MiB that do not grow with the model (0.4% at pythia-1b);
    # unpatched, the same API peaks ~20 MiB higher on this model (one random init + copy of the largest tensors)
    assert abs(api["peak"] - entry["peak"]) <= 0.02 * entry["peak"] + 8 * 2**20, (entry["peak"], api["peak"])
    assert entry["tokens"] == script["tokens"] == api["tokens"]

    assert re.search(r"[\d.]+ tokens/sec", script["stderr"])  # the script's own report
    assert re.search(r"weights [\d.]+ MiB, KV cache [\d.]+ KiB, mask [\d.]+ KiB, RoPE [\d.]+ KiB", script["stderr"])
    assert "peak RSS" in script["stderr"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quantize", [None, "bnb.nf4"])
def test_cuda_caches_on_the_device_and_device_peak(tmp_path, tiny_config, write_litgpt_dir, quantize):
    config = tiny_config("gqa")
    directory = write_litgpt_dir(tmp_path / "cuda", config, torch.bfloat16)
    result = generate(directory, PROMPT, max_new_tokens=8, temperature=0.0, device="cuda", quantize=quantize)
    assert result.tokens[0].device.type == "cuda"
    assert result.memory.kv_cache == estimate_memory(directory, quantize=quantize, max_seq_length=14).kv_cache
    assert result.memory.device_peak is not None and result.memory.device_peak > result.memory.weights


OFFLOADED_FIRST = ["transformer.wte", "transformer.h.0", "transformer.h.1"]
"""Layers kept on the host, the input embedding among them: the first parameter is not where the model computes."""


def test_a_model_whose_first_layers_are_offloaded_computes_where_its_offload_runs(tiny_config, tiny_gpt):
    """The device of a model handed to generate and setup_kv_cache is the one its offload brings layers to, not its
    first parameter's (the input embedding's master, on the host); a CPU check of the decision, on meta."""
    model = tiny_gpt(tiny_config("gqa"))
    assert model_device(model) == torch.device("cpu")
    handle = layer_offload(model, "meta", layers=OFFLOADED_FIRST)
    assert model.transformer.wte.weight.device.type == "cpu"  # the master: where the first parameter is
    assert model_device(model) == torch.device("meta")
    handle.remove()
    assert model_device(model) == torch.device("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_generate_on_a_model_whose_embedding_is_offloaded(tiny_config, tiny_gpt):
    model = tiny_gpt(tiny_config("gqa")).cuda()
    expected = generate(model, [1, 2, 3], max_new_tokens=6, temperature=0.0).tokens[0].tolist()
    layer_offload(model, "cuda", layers=OFFLOADED_FIRST)
    assert model.transformer.wte.weight.device.type == "cpu"
    result = generate(model, [1, 2, 3], max_new_tokens=6, temperature=0.0)
    assert result.tokens[0].device.type == "cuda" and result.tokens[0].tolist() == expected


def test_a_text_prompt_without_a_tokenizer_fails_before_any_read(tmp_path, tiny_config, write_litgpt_dir,
                                                                 read_recorder):
    directory = write_litgpt_dir(tmp_path / "ids", tiny_config("pythia"), tokenizer=False)
    with pytest.raises(ValueError, match="No tokenizer in the checkpoint directory"):
        generate(directory, "What do llamas eat?", max_new_tokens=4)
    with pytest.raises(ValueError, match="block size"):
        generate(directory, "1 2 3", max_new_tokens=62)
    assert read_recorder.keys == []


def test_config_by_litgpt_name_as_the_cli_takes_it_or_a_type_error(pythia_14m_hf_dir):
    """``config="pythia-14m"`` is read as ``--config pythia-14m`` is; anything but a name, a Config or a path is a
    TypeError naming what to pass."""
    from litgpt import Config

    directory, _ = pythia_14m_hf_dir
    by_name = generate(directory, [1, 2, 3], max_new_tokens=3, temperature=0.0, config="pythia-14m")
    by_config = generate(directory, [1, 2, 3], max_new_tokens=3, temperature=0.0,
                         config=Config.from_name("pythia-14m"))
    assert torch.equal(by_name.tokens[0], by_config.tokens[0])
    est = estimate_memory(directory, config="pythia-14m", max_seq_length=64)
    assert est.model == "pythia-14m" and est.weights == estimate_memory("pythia-14m", max_seq_length=64).weights
    with pytest.raises(TypeError, match=r"config=14 \(int\) is not a litgpt config. Pass a litgpt model name"):
        generate(directory, [1, 2, 3], config=14)
    with pytest.raises(TypeError, match=r"config=\{'name': 'pythia-14m'\} \(dict\)"):
        estimate_memory(directory, config={"name": "pythia-14m"})
    with pytest.raises(ValueError, match="config='pythia-14mm' is neither a model_config.yaml file nor a litgpt"):
        estimate_memory(directory, config="pythia-14mm")


def test_int8_generation_tells_its_input_cast_once(tmp_path, tiny_config, write_litgpt_dir, caplog):
    """bitsandbytes' int8 matmul logs its bf16 -> fp16 input cast on every call (once per layer per token): told
    once per generate() call, every other message of that logger kept."""
    import logging

    directory = write_litgpt_dir(tmp_path / "tiny", tiny_config(n_embd=128), torch.bfloat16, tokenizer=False)
    caplog.set_level(logging.WARNING)
    for _ in range(2):
        generate(directory, [1, 2, 3], max_new_tokens=6, quantize="bnb.int8", top_k=1)
    casts = [r.getMessage() for r in caplog.records if r.name == "bitsandbytes.autograd._functions"]
    assert casts == ["MatMul8bitLt: inputs will be cast from torch.bfloat16 to float16 during quantization"] * 2
    assert logging.getLogger("bitsandbytes.autograd._functions").filters == []
