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


@pytest.mark.parametrize("scheme", ["bnb.int8", "bnb.nf4", "torchao.int8wo"])
def test_gpt2_conv1d_layers_are_quantized_as_transformers_bitsandbytes_does(tmp_path, scheme):
    """transformers' Conv1D holds its weight (in, out): it is replaced by the scheme's Linear, the weight transposed."""
    if scheme not in ON_CPU:
        pytest.skip(f"{scheme} has no kernel on CPU here")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with init_empty():
        model = transformers.GPT2LMHeadModel(config)
    report = load_checkpoint(model, tmp_path, quantize=scheme, progress=False)
    conv1d = {name for name, m in transformers.GPT2LMHeadModel(config).named_modules() if type(m).__name__ == "Conv1D"}
    assert set(report.quantized) == conv1d and len(conv1d) == 8
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.eval()(ids).logits
        full = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()(ids).logits
    if scheme.startswith("bnb"):
        bnb_config = (transformers.BitsAndBytesConfig(load_in_8bit=True) if scheme == "bnb.int8" else
                      transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                      bnb_4bit_compute_dtype=torch.float32))
        theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, quantization_config=bnb_config,
                                                              device_map="cpu").eval()
        with torch.no_grad():
            torch.testing.assert_close(ours, theirs(ids).logits, rtol=0, atol=1e-5)
    assert 0 < (ours - full).abs().max() < 0.2  # quantized, and close to full precision


def test_a_load_that_quantizes_nothing_says_what_it_saw(tmp_path):
    from safetensors.torch import save_file

    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten())
    save_file(conv.state_dict(), tmp_path / "conv.safetensors")
    with init_empty():
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten())
    with pytest.warns(UserWarning, match=r"quantize='bnb\.int8' quantizes nothing in Sequential: it quantizes nn\.Linear,"
                                         r" transformers' Conv1D and modules whose forward is F\.linear\(input, weight, "
                                         r"bias\); the layers with weights here are Conv2d x 1\. A linear layer of another "
                                         r"class is quantized with treat_as_linear=TheClass"):
        report = load_checkpoint(model, tmp_path / "conv.safetensors", quantize="bnb.int8")
    assert report.quantized == {}


def test_a_load_into_an_already_quantized_model_does_not_warn_that_nothing_is_quantized(tmp_path):
    """Adapters (here a bias) loaded with the same quantize= into a model the first load quantized."""
    import warnings

    from safetensors.torch import save_file

    torch.manual_seed(0)
    save_file(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)).state_dict(), tmp_path / "model.safetensors")
    with init_empty():
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    load_checkpoint(model, tmp_path / "model.safetensors", quantize="bnb.nf4", skip_quantize=[], progress=False)
    save_file({"1.bias": torch.ones(8)}, tmp_path / "bias.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_checkpoint(model, tmp_path / "bias.safetensors", quantize="bnb.nf4", skip_quantize=[], strict=False,
                        progress=False)
    assert torch.equal(model[1].bias, torch.ones(8))
