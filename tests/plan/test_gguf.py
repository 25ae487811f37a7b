"""GGUF names and layouts -> transformers', with transformers' own name map and tensor processors: a meta-built
LlamaForCausalLM loaded from F16, Q8_0 and Q4_0 files gives transformers' own logits, bit for bit, and a load's
peak memory stays near the final model where transformers' own GGUF load holds the whole model in float32 first."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from lightning_lowmem import (
    Checkpoint,
    CheckpointFormatError,
    CheckpointMismatchError,
    LoadOptions,
    init_empty,
    load_checkpoint,
)
from lightning_lowmem.engine import estimate_prepared, prepare_load, resolved
from lightning_lowmem.formats.gguf_file import DEQUANTIZE_WORKSPACE
from lightning_lowmem.plan.gguf import gguf_config, gguf_to_transformers


def _meta_llama(path):
    import transformers

    with init_empty():
        return transformers.LlamaForCausalLM(gguf_config(path))


def test_loads_what_transformers_loads_bit_for_bit(tiny_gguf, gguf_kind, gguf_from_pretrained, forward_logits):
    path = tiny_gguf[gguf_kind]
    model = _meta_llama(path)
    conversion = gguf_to_transformers(path, model)
    report = load_checkpoint(model, path, key_map=conversion.key_map, transform=conversion.transform,
                             dtype=torch.float32, progress=False)
    reference = gguf_from_pretrained(path)
    assert torch.equal(forward_logits(model.eval()), forward_logits(reference))
    with Checkpoint.open(path) as ckpt:
        assert report.bytes_read == sum(rec.nbytes for rec in ckpt.records.values())  # the stored bytes
    assert conversion.names["blk.0.attn_q.weight"] == "model.layers.0.self_attn.q_proj.weight"
    assert conversion.skipped == []


def test_the_llama_q_and_k_permutation_is_reversed(tiny_gguf, write_gguf, tmp_path):
    original = write_gguf(tmp_path / "again.gguf", "F16")  # the same weights as tiny_gguf's, before conversion
    model = _meta_llama(tiny_gguf["F16"])
    conversion = gguf_to_transformers(tiny_gguf["F16"], model)
    load_checkpoint(model, tiny_gguf["F16"], key_map=conversion.key_map, transform=conversion.transform,
                    dtype=torch.float32, progress=False)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        want = original.get_parameter(name).detach().half().float()
        assert torch.equal(model.get_parameter(name), want), name
    with Checkpoint.open(tiny_gguf["F16"]) as ckpt:  # stored permuted: not equal as read
        assert not torch.equal(ckpt.read("blk.0.attn_q.weight").float(),
                               original.model.layers[0].self_attn.q_proj.weight.detach().half().float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_quantized_tensors_load_by_blocks_of_whole_heads_as_transformers_loads_them(
        tiny_gguf, gguf_from_pretrained, read_recorder, monkeypatch, dtype):
    """q (4 heads of 16 rows) and k (2 heads) un-permuted two heads at a time; in bf16, every 2-d tensor cast by
    blocks (in float32, those the processor leaves as they are are dequantized straight into place)."""
    monkeypatch.setattr("lightning_lowmem.quantize.rows.CHUNK_ELEMENTS", 40 * 64)  # 40 rows -> 2 heads of 16
    path = tiny_gguf["Q4_0"]
    model = _meta_llama(path)
    conversion = gguf_to_transformers(path, model)
    assert conversion.row_block("model.layers.0.self_attn.q_proj.weight") == 16
    assert conversion.row_block("model.layers.0.mlp.up_proj.weight") == 0  # left as it is by the processor
    load_checkpoint(model, path, key_map=conversion.key_map, transform=conversion.transform, dtype=dtype,
                    progress=False)
    assert ("blk.0.attn_q.weight", 0, 32) in read_recorder.rows and ("blk.0.attn_q.weight", 32, 64) in read_recorder.rows
    assert not [key for key in read_recorder.whole if key.endswith("attn_q.weight")]  # k: 2 heads, one block
    cast = dtype == torch.bfloat16
    assert (("token_embd.weight", 0, 40) in read_recorder.rows) == cast
    assert ("token_embd.weight" in read_recorder.whole) == (not cast)
    reference = gguf_from_pretrained(path, dtype=dtype)
    for name, want in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], want), name


@pytest.mark.parametrize("quantize", ["torchao.int8wo", "bnb.int8"])
def test_quantized_by_blocks_of_whole_heads_equals_quantized_whole(tiny_gguf, read_recorder, monkeypatch, quantize):
    """The permuted q and k, read and un-permuted two heads at a time and quantized by rows, give the bytes the
    whole weight quantized gives (both schemes scale each row on its own)."""
    path = tiny_gguf["Q8_0"]

    def load() -> dict:
        model = _meta_llama(path)
        conversion = gguf_to_transformers(path, model)
        load_checkpoint(model, path, key_map=conversion.key_map, transform=conversion.transform, quantize=quantize,
                        dtype=torch.bfloat16, progress=False)
        return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}

    whole = load()
    monkeypatch.setattr("lightning_lowmem.quantize.rows.CHUNK_ELEMENTS", 24 * 64)  # 24 rows: heads of 16 split
    read_recorder.calls.clear()
    by_rows = load()
    assert ("blk.0.attn_q.weight", 16, 48) in read_recorder.rows  # rows 24..48 asked: heads 1 and 2 read
    assert whole.keys() == by_rows.keys()
    for key in whole:
        assert all(torch.equal(a, b) for a, b in zip(_plain(whole[key]), _plain(by_rows[key]), strict=True)), key


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data (a torchao tensor subclass's inner tensors)."""
    if not hasattr(t, "__tensor_flatten__") or type(t) is torch.Tensor:
        return [t]
    names, _ = t.__tensor_flatten__()
    return [p for name in names for p in _plain(getattr(t, name))]


def test_a_tied_head_is_the_embedding(tmp_path, write_gguf, gguf_from_pretrained, forward_logits):
    path = tmp_path / "tied.gguf"
    write_gguf(path, "Q8_0", tie=True)
    model = _meta_llama(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    conversion = gguf_to_transformers(path, model)
    load_checkpoint(model, path, key_map=conversion.key_map, transform=conversion.transform, dtype=torch.float32,
                    progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(forward_logits(model.eval()), forward_logits(gguf_from_pretrained(path)))


@pytest.mark.parametrize("quantize", [None, "torchao.int8wo", "bnb.int8"])
def test_bf16_and_quantized_on_load(tiny_gguf, gguf_from_pretrained, forward_logits, quantize):
    path = tiny_gguf["Q8_0"]
    model = _meta_llama(path)
    conversion = gguf_to_transformers(path, model)
    report = load_checkpoint(model, path, key_map=conversion.key_map, transform=conversion.transform,
                             dtype=torch.bfloat16, quantize=quantize, progress=False)
    reference = forward_logits(gguf_from_pretrained(path))
    got = forward_logits(model.eval())
    assert (got - reference).abs().max() < 0.1 * reference.abs().max()
    assert bool(report.quantized) == (quantize is not None)


def test_the_plan_reads_stored_bytes_and_the_estimate_counts_a_block_of_rows(tiny_gguf, monkeypatch):
    """Dequantized and cast a block of rows at a time, a tensor is never held in float32 whole: the estimate's
    transient is one block (40 rows here) and the dequantization's workspace, not the embedding in float32."""
    from lightning_lowmem.engine.memory_estimate import LOAD_RUNTIME

    monkeypatch.setattr("lightning_lowmem.quantize.rows.CHUNK_ELEMENTS", 40 * 64)
    path = tiny_gguf["Q4_0"]
    model = _meta_llama(path)
    conversion = gguf_to_transformers(path, model)
    options = LoadOptions(key_map=conversion.key_map, transform=conversion.transform, dtype=torch.bfloat16)
    with resolved(path, model, options) as source:
        prepared = prepare_load(model, source, options)
    assert prepared.plan.nbytes == sum(t.record.nbytes for t in prepared.plan.targets)
    est = estimate_prepared(prepared, model="tiny", dtype=torch.bfloat16, batch_size=1, max_seq_length=16,
                            prompt_length=4, with_caches=False)
    q_block = 32 * 64 * 4 * 2  # two heads of q as read, and un-permuted
    assert est.load_transient == max(40 * 64 * 4, q_block) + DEQUANTIZE_WORKSPACE + LOAD_RUNTIME
    assert est.weights == sum(p.numel() * 2 for p in model.parameters())


def test_a_family_transformers_only_renames_needs_no_transform(tiny_gguf, read_recorder, monkeypatch):
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor

    from lightning_lowmem import GGUFConversion

    path = tiny_gguf["Q8_0"]
    model = _meta_llama(path)
    llama = gguf_to_transformers(path, model)
    renamed_only = GGUFConversion(llama.names, TensorProcessor(), "qwen2")  # as for a family with no processor
    assert llama.transform is not None and renamed_only.transform is None
    monkeypatch.setattr("lightning_lowmem.quantize.rows.CHUNK_ELEMENTS", 16 * 128)  # blocks of rows, tiny model
    load_checkpoint(model, path, key_map=renamed_only.key_map, transform=renamed_only.transform,
                    quantize="torchao.int8wo", dtype=torch.bfloat16, progress=False)
    assert ("blk.0.ffn_down.weight", 0, 16) in read_recorder.rows  # quantized by blocks of rows, never whole
    assert "blk.0.ffn_down.weight" not in read_recorder.whole


def test_one_call_loads_a_gguf_into_the_model_its_config_builds(tiny_gguf, gguf_kind, gguf_from_pretrained,
                                                                 forward_logits):
    """No key map, no transform: the resolver picks transformers' GGUF conversion from what the module and the
    file are, and the logits equal ``from_pretrained(gguf_file=...)``'s bit for bit."""
    path = tiny_gguf[gguf_kind]
    model = _meta_llama(path)
    report = load_checkpoint(model, path, dtype=torch.float32, progress=False)
    assert torch.equal(forward_logits(model.eval()), forward_logits(gguf_from_pretrained(path)))
    assert report.conversion.startswith("GGUF -> transformers (llama")


def test_an_explicit_key_map_replaces_the_conversion(tiny_gguf):
    """Keys the caller maps are the caller's: no conversion is added, so these GGUF names do not fit."""
    model = _meta_llama(tiny_gguf["Q8_0"])
    with pytest.raises(CheckpointMismatchError, match=r"blk\.0\.attn_k\.weight"):
        load_checkpoint(model, tiny_gguf["Q8_0"], key_map={"unused.": ""}, progress=False)


def test_a_family_transformers_rebuilds_across_tensors_is_refused(tmp_path, write_gguf_tensors):
    import transformers

    path = write_gguf_tensors(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": np.zeros((8, 32), np.float32)})
    with init_empty():
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=8))
    with pytest.raises(CheckpointFormatError, match=r"gpt2\.gguf is a 'gpt2' GGUF file.*GPT2TensorProcessor"):
        gguf_to_transformers(path, model)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        gguf_to_transformers(path, torch.nn.Linear(2, 2))


# ---------------------------------------------------------------- peak memory, in fresh processes

CHILD = textwrap.dedent(
    """
    import json, sys, torch, transformers
    from pathlib import Path
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # imported before the blocks measured
    import gguf, transformers.integrations.ggml, transformers.modeling_gguf_pytorch_utils
    from lightning_lowmem import MemoryMonitor, init_empty, load_checkpoint
    from lightning_lowmem.plan.gguf import gguf_config, gguf_to_transformers
    method, path = sys.argv[1], Path(sys.argv[2])
    with MemoryMonitor() as whole:
        if method == "lowmem":
            with init_empty():
                model = LlamaForCausalLM(gguf_config(path))
            conversion = gguf_to_transformers(path, model)
            with MemoryMonitor() as load:
                load_checkpoint(model, path, key_map=conversion.key_map, transform=conversion.transform,
                                dtype=torch.bfloat16, progress=False)
        else:
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16)
            load = whole
    final = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(json.dumps({"peak": whole.usage.rss_peak_delta, "load": load.usage.rss_peak_delta, "final": final}))
    """
)


@pytest.fixture(scope="module")
def large_gguf(tmp_path_factory, write_gguf):
    """A 4-layer, 1024-dim Llama with a 16k vocabulary (77 M parameters: 147 MiB in bf16) as Q8_0, no vocabulary."""
    path = tmp_path_factory.mktemp("large-gguf") / "large.Q8_0.gguf"
    write_gguf(path, "Q8_0", hidden=1024, intermediate=2816, layers=4, heads=16, kv_heads=4, vocab=False,
               vocab_size=16384, std=0.02)
    return path


@pytest.mark.slow
def test_peak_is_the_final_model_where_transformers_holds_it_all(large_gguf, child_env):
    """Above the RSS after imports. Measured (2 shared cores): config, meta build and conversion +9 MiB, the load
    +164 MiB for a 150 MiB bf16 model (each tensor dequantized and cast a block of rows at a time into its final
    tensor; read whole in float32 first, it took +220 MiB); transformers' from_pretrained(gguf_file=...,
    dtype=torch.bfloat16) +480 MiB. Bound: the model + 32 MiB."""
    def run(method: str) -> dict:
        proc = subprocess.run([sys.executable, "-c", CHILD, method, str(large_gguf)], capture_output=True, text=True,
                              env=child_env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    ours, theirs = run("lowmem"), run("transformers")
    assert ours["final"] == theirs["final"]
    assert ours["load"] <= ours["final"] + 32 * 2**20, (ours, theirs)
    assert ours["peak"] < theirs["peak"], (ours, theirs)
