"""HF checkpoints into litgpt's GPT: exactly what litgpt's own converter writes, streamed (q, k, v fused as read)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_lowmem import CheckpointFormatError, CheckpointMismatchError, generate
from lightning_lowmem.litgpt.generation import load_for_generation
from lightning_lowmem.quantize import schemes_available_on

IDS = torch.tensor([[5, 17, 3, 99, 42, 8]])
CASES = {  # id: (family, tied embeddings, save_pretrained's max_shard_size)
    "llama": ("llama", False, None),
    "llama-gqa-tied-sharded": ("llama-gqa", True, "20KB"),
    "qwen2.5-qkv-bias": ("qwen2.5", False, None),
    "gemma-tied": ("gemma", True, None),
    "phi-3-fused-in-the-file": ("phi-3", False, None),
    "olmo-2-qk-norms": ("olmo-2", False, None),
}



@pytest.mark.parametrize("case", ["llama-gqa-tied-sharded", "phi-3-fused-in-the-file"])
def test_load_checkpoint_converts_an_hf_directory_into_gpt(tmp_path, write_hf_dir, litgpt_converted, meta_gpt, case):
    """One call, no key map: the resolver picks litgpt's own conversion because the module is a GPT and the names
    are HF's; the tensors equal litgpt's convert_hf_checkpoint."""
    from lightning_lowmem import load_checkpoint

    family, tie, shards = CASES[case]
    directory = tmp_path / "hf"
    _, config = write_hf_dir(directory, family, tie=tie, max_shard_size=shards, tokenizer=False)
    reference = torch.load(litgpt_converted(directory, config, tmp_path / "converted") / "lit_model.pth")
    model = meta_gpt(config)
    report = load_checkpoint(model, directory, dtype=torch.float32, progress=False)
    assert report.conversion.startswith("HF -> litgpt (copy_weights_")
    assert model.state_dict().keys() == reference.keys()
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in reference.items())


@pytest.mark.parametrize("case", CASES)
def test_streamed_equals_litgpts_conversion(tmp_path, write_hf_dir, litgpt_converted, read_recorder, case):
    from litgpt import GPT
    from litgpt.generate.base import generate as litgpt_generate

    family, tie, shards = CASES[case]
    directory = tmp_path / "hf"
    hf, config = write_hf_dir(directory, family, tie=tie, max_shard_size=shards, tokenizer=False)
    assert not shards or len(list(directory.glob("*.safetensors"))) >= 4
    converted = litgpt_converted(directory, config, tmp_path / "converted")
    read_recorder.calls.clear()  # the load's reads only
    model, _, report = load_for_generation(directory, precision="32-true")
    reads = read_recorder.keys

    reference = torch.load(converted / "lit_model.pth")
    ours = model.state_dict()
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), name
    assert report.skipped == [] and report.missing == []
    assert sorted(reads) == sorted(set(reads))  # each checkpoint tensor read once (Phi-3's gate_up_proj feeds two)
    assert (model.lm_head.weight is model.transformer.wte.weight) == tie  # no lm_head in the file: held once
    for layer in range(2 if family != "phi-3" else 0):  # the parts of each fused tensor are read one after the other
        for kind in ("weight", "bias") if config.attn_bias else ("weight",):
            at = sorted(reads.index(f"model.layers.{layer}.self_attn.{p}_proj.{kind}") for p in "qkv")
            assert at == list(range(at[0], at[0] + 3)), reads

    litgpt_model = GPT(config).eval()
    litgpt_model.load_state_dict(reference)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), litgpt_model(IDS), rtol=0, atol=0)
        torch.testing.assert_close(model(IDS), hf(IDS).logits, rtol=1e-4, atol=1e-4)
    litgpt_model.max_seq_length = 16  # litgpt's generate on its converted weights, greedy, from token ids
    litgpt_model.set_kv_cache(batch_size=1)
    expected = litgpt_generate(litgpt_model, IDS[0], 16, top_k=1).tolist()
    assert generate(directory, IDS[0], max_new_tokens=10, top_k=1, precision="32-true").tokens[0].tolist() == expected


def test_missing_part_is_named_before_any_read(tmp_path, write_hf_dir, read_recorder):
    directory = tmp_path / "hf"
    write_hf_dir(directory, "llama-gqa", tokenizer=False)
    weights = load_file(directory / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    named = r"'model\.layers\.1\.self_attn\.k_proj\.weight' for 'transformer\.h\.1\.attn\.qkv\.weight'"
    with pytest.raises(CheckpointMismatchError, match=named):
        generate(directory, "1 2 3", max_new_tokens=2)
    assert read_recorder.keys == []


@pytest.mark.skipif("bnb.nf4" not in schemes_available_on(torch.device("cpu")), reason="no bnb.nf4 on CPU here")
def test_nf4_quantizes_the_fused_qkv_as_litgpts_checkpoint(tmp_path, write_hf_dir, litgpt_converted):
    directory = tmp_path / "hf"
    _, config = write_hf_dir(directory, "llama-gqa", hidden=64, tokenizer=False)
    converted = litgpt_converted(directory, config, tmp_path / "converted")
    model, _, report = load_for_generation(directory, quantize="bnb.nf4", precision="bf16-true")
    reference, _, expected = load_for_generation(converted, quantize="bnb.nf4", precision="bf16-true")
    assert "transformer.h.1.attn.qkv" in report.quantized and report.quantized == expected.quantized
    assert report.quantized_bytes_after == expected.quantized_bytes_after
    with torch.no_grad():
        logits = model(IDS)
        torch.testing.assert_close(logits, reference(IDS), rtol=0, atol=0)
    assert logits.isfinite().all()


def test_a_checkpoint_litgpts_conversion_refuses_fails_before_reading(tmp_path, tiny_config, read_recorder):
    """litgpt converts Falcon 7b, 40b and 180B only; other sizes fail with what to do, before any read."""
    from litgpt.utils import save_config
    from transformers import FalconConfig, FalconForCausalLM

    directory = tmp_path / "falcon-tiny"
    FalconForCausalLM(FalconConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
                      ).save_pretrained(directory)
    save_config(tiny_config("pythia", name="falcon-tiny", vocab_size=128), directory)
    with pytest.raises(CheckpointFormatError, match=r"'falcon-tiny'.*NotImplementedError.*convert_to_litgpt"):
        generate(directory, "1 2 3", max_new_tokens=2)
    assert read_recorder.keys == []


@pytest.mark.parametrize("scheme", ["bnb.nf4-dq", "bnb.int8"])
def test_a_prequantized_checkpoint_fuses_qkv_from_dequantized_parts(tmp_path, hf_prequantized, hf_from_pretrained,
                                                                   litgpt_converted, tiny_config, scheme):
    """transformers saved q, k, v quantized apart; litgpt's qkv is built from their dequantized values and quantized
    again in the same scheme, one layer at a time: the qkv equals litgpt's own conversion of the dequantized
    model, quantized on load; every other Linear loads as stored."""
    from litgpt import Config

    directory = hf_prequantized(scheme)
    model, _, report = load_for_generation(directory, precision="bf16-true")
    qkv = {f"transformer.h.{i}.attn.qkv": scheme for i in range(2)}
    assert report.requantized == qkv and report.quantized.keys() == report.prequantized.keys() | qkv.keys()
    assert len(report.prequantized) == 8 and "rebuilt from stored quantized parts" in str(report)

    hf = hf_from_pretrained(directory)  # no forward before dequantize: the first repacks 4-bit weights for the CPU
    hf.dequantize()  # the values the parts stand for, in bf16
    (tmp_path / "dequantized").mkdir()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "dequantized" / "model.safetensors")
    config = Config.from_file(directory / "model_config.yaml")
    converted = litgpt_converted(tmp_path / "dequantized", config, tmp_path / "converted")
    reference, _, _ = load_for_generation(converted, quantize=scheme, precision="bf16-true")
    for name in qkv:  # before any forward: bitsandbytes repacks 4-bit weights for its CPU kernel in the first
        ours, theirs = model.get_submodule(name).weight, reference.get_submodule(name).weight
        assert torch.equal(ours.data, theirs.data), name
        for key in ("absmax", "SCB"):
            if getattr(theirs, key, None) is not None:
                assert torch.equal(getattr(ours, key), getattr(theirs, key)), (name, key)
    with torch.no_grad():  # q, k and v went through two quantizations: close to transformers', not equal
        expected = hf_from_pretrained(directory)(IDS).logits.float()
        torch.testing.assert_close(model(IDS).float(), expected, rtol=0.05, atol=0.15)
    tokens = generate(directory, IDS[0], max_new_tokens=5, top_k=1).tokens[0]
    assert tokens.shape == (IDS.shape[1] + 5,)


def test_gpt_neox_fused_qkv_is_read_head_by_head_into_place(tmp_path, tiny_config, tiny_gpt, meta_gpt, read_recorder):
    """GPT-NeoX stores q, k, v interleaved head by head in one ``query_key_value``; litgpt's conversion reorders them
    (``qkv_reassemble``). Each head's rows are read straight into their place in litgpt's qkv, a run of rows at a
    time, never the whole fused tensor beside the result; the tensors equal litgpt's conversion bit for bit."""
    from litgpt.scripts.convert_hf_checkpoint import copy_weights_gpt_neox as to_litgpt
    from litgpt.scripts.convert_lit_checkpoint import copy_weights_gpt_neox as to_hf

    from lightning_lowmem import load_checkpoint

    config = tiny_config("pythia", n_head=4, n_embd=32)
    reference = tiny_gpt(config, torch.float32, std=0.3)
    hf_state: dict[str, torch.Tensor] = {}
    to_hf(config, hf_state, reference.state_dict())
    save_file({k: v.contiguous() for k, v in hf_state.items()}, tmp_path / "model.safetensors")
    expected: dict[str, torch.Tensor] = {}
    to_litgpt(config, expected, load_file(tmp_path / "model.safetensors"))

    model = meta_gpt(config)
    report = load_checkpoint(model, tmp_path / "model.safetensors", dtype=torch.float32, progress=False)
    assert report.conversion.startswith("HF -> litgpt (copy_weights_gpt_neox")
    ours = model.state_dict()
    assert expected.keys() == reference.state_dict().keys()
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor) and torch.equal(ours[name], reference.state_dict()[name]), name
    head = config.head_size
    for kind, row in (("weight", head), ("bias", head)):
        key = f"gpt_neox.layers.0.attention.query_key_value.{kind}"
        runs = [(start, stop) for k, start, stop in read_recorder.calls if k == key]
        assert len(runs) == 3 * config.n_head and all(stop - start == row for start, stop in runs), runs
        assert sorted(runs) == [(i, i + row) for i in range(0, 3 * config.n_embd, row)]  # each row once


def test_q_k_v_concatenated_by_litgpt_are_declared_stacks_equal_to_a_probe(tmp_path, write_hf_dir, monkeypatch):
    """litgpt's conversion seen (traced on meta) concatenating the checkpoint's own q, k, v along rows declares the
    stack, with no probe to pay for it; the declaration equals what a probe at the real shapes finds."""
    import dataclasses

    from lightning_lowmem import Checkpoint
    from lightning_lowmem.litgpt.hf import hf_to_litgpt
    from lightning_lowmem.plan import combine
    from lightning_lowmem.plan.combine import with_stacks

    _, config = write_hf_dir(tmp_path, "llama-gqa", tie=False, max_shard_size=None, tokenizer=False)
    with Checkpoint.open(tmp_path) as ckpt:
        monkeypatch.setattr(combine, "PROBE_ELEMENTS", 0)  # nothing probed: what is a stack is declared
        declared = hf_to_litgpt(config, ckpt.records).combine
        monkeypatch.undo()
        probed = with_stacks(dataclasses.replace(declared, stacks={}), ckpt.records)
    qkv = {f"transformer.h.{i}.attn.qkv.weight" for i in range(config.n_layer)}
    assert set(declared.stacks) == qkv and declared.stacks == probed.stacks
