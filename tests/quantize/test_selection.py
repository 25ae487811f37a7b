"""Which Linears are quantized: skip_quantize globs, tied embeddings and output heads left in full precision."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem import init_empty, load_checkpoint
from lightning_lowmem.quantize import schemes_available_on

ON_CPU = schemes_available_on(torch.device("cpu"))
bnb = pytest.importorskip("bitsandbytes")


def test_skip_quantize_globs(quant_checkpoint, quant_load, quant_linears):
    model, report = quant_load(quant_checkpoint, quantize="torchao.int8wo",
                               skip_quantize=["transformer.h.0.*", "*.proj"])
    assert set(report.quantized) == {"lm_head", "transformer.h.1.attn.qkv", "transformer.h.1.mlp.fc"}
    for name in quant_linears(skip=()) - set(report.quantized):
        assert model.get_submodule(name).weight.__class__ is nn.Parameter, name
    assert type(model.lm_head.weight).__name__ == "Int8Tensor"


def test_a_skip_pattern_that_matches_no_module_is_a_warning(quant_checkpoint, quant_load):
    with pytest.warns(UserWarning, match=r"skip_quantize patterns 'model\.transformer\.h\.0\.\*' match no module.*"
                                         r"'transformer\.h\.0\.attn\.qkv'"):
        _, report = quant_load(quant_checkpoint, quantize="torchao.int8wo", skip_quantize="model.transformer.h.0.*")
    assert "transformer.h.0.attn.qkv" in report.quantized  # the warning says why


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Llama with tied embeddings and a GPT-NeoX with its own output head, written sharded by save_pretrained."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    configs = {
        "llama-tied": transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64, tie_word_embeddings=True),
        "neox": transformers.GPTNeoXConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                                           num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.25,
                                           max_position_embeddings=64, tie_word_embeddings=False),
    }
    for name, config in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        model.save_pretrained(root / name, max_shard_size="100KB")  # a sharded index set
    return root, configs


def hf_load(root, configs, name, **kwargs):
    from transformers import AutoModelForCausalLM

    with init_empty():
        model = AutoModelForCausalLM.from_config(configs[name])
    report = load_checkpoint(model, root / name, dtype=torch.bfloat16, **kwargs)
    return model, report


@pytest.mark.parametrize("scheme", [s for s in ["bnb.nf4", "bnb.int8", "torchao.int8wo"] if s in ON_CPU])
def test_transformers_tied_embeddings_stay_tied(hf_checkpoints, scheme, quantize_after_load, assert_same_weights,
                                                forward_logits):
    root, configs = hf_checkpoints
    for skip in (None, []):  # even when told to quantize everything, a tied head is left alone
        model, report = hf_load(root, configs, "llama-tied", quantize=scheme, skip_quantize=skip)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
        assert "lm_head" not in report.quantized and len(report.quantized) == 14
    full, _ = hf_load(root, configs, "llama-tied")
    ref = quantize_after_load(full, scheme)
    assert_same_weights(model, ref)
    torch.testing.assert_close(forward_logits(model), forward_logits(ref), rtol=0, atol=0)


def test_transformers_output_embeddings_skipped_by_default(hf_checkpoints, forward_logits):
    root, configs = hf_checkpoints
    model, report = hf_load(root, configs, "neox", quantize="bnb.nf4")
    assert type(model.embed_out) is nn.Linear and "embed_out" not in report.quantized  # get_output_embeddings()
    assert type(model.gpt_neox.layers[0].mlp.dense_h_to_4h) is bnb.nn.Linear4bit
    model, report = hf_load(root, configs, "neox", quantize="bnb.nf4", skip_quantize=[])
    assert type(model.embed_out) is bnb.nn.Linear4bit and "embed_out" in report.quantized
    assert forward_logits(model).isfinite().all()
