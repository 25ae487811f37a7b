"""Checkpoints into transformers models through transformers' own conversion mapping: MoE checkpoints that store one
tensor per expert (as every Mixtral / Qwen-MoE checkpoint and transformers' own ``save_pretrained`` do) load into the
fused experts transformers 5 builds, with one call and no key map."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from lightning_lowmem import (
    Checkpoint,
    CheckpointMismatchError,
    UnsupportedQuantizationError,
    init_empty,
    load_checkpoint,
    save_checkpoint,
)
from lightning_lowmem.quantize import BnbNF4, module_nbytes
from lightning_lowmem.transformers.release import at_least, spelled

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not at_least(5), reason=f"transformers {spelled()} keeps one module per expert and has "
                                "no conversion mapping: both came with transformers 5")

EXPERTS = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, write_moe_dir):
    """``moe_dir(family, layout)``: a directory written by ``save_pretrained`` (``safetensors``: one file;
    ``sharded``: shards of 100 KB and an index), each written once."""
    made = {}

    def get(family: str, layout: str = "safetensors"):
        if (family, layout) not in made:
            directory = tmp_path_factory.mktemp(f"{family}-{layout}")
            write_moe_dir(directory, family, max_shard_size="100KB" if layout == "sharded" else None)
            made[family, layout] = directory
        return made[family, layout]

    return get


def _built(directory, on: str = "init_empty", dtype: torch.dtype = torch.float32):
    config = transformers.AutoConfig.from_pretrained(directory)
    if on == "init_empty":
        with init_empty():
            return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("layout", ["safetensors", "sharded"])
@pytest.mark.parametrize("built", ["init_empty", "meta device"])
def test_per_expert_checkpoints_load_into_fused_experts(moe_dir, hf_from_pretrained, forward_logits, read_recorder,
                                                        family, layout, built):
    directory = moe_dir(family, layout)
    model = _built(directory, built)
    report = load_checkpoint(model, directory, progress=False)

    reference = hf_from_pretrained(directory)
    assert report.conversion.startswith(f"transformers' conversion mapping ({family}, ")
    files = sorted(directory.glob("*.safetensors"))
    assert report.files == files and (len(files) > 1) == (layout == "sharded")
    for (name, ours), (ref_name, theirs) in zip(model.state_dict().items(), reference.state_dict().items(),
                                                strict=True):
        assert name == ref_name and torch.equal(ours, theirs), name
    assert torch.equal(forward_logits(model), forward_logits(reference))
    with Checkpoint.open(directory) as ckpt:  # every tensor of the checkpoint read once, each expert's on its own
        assert Counter(read_recorder.keys) == Counter(list(ckpt.records))


def test_each_expert_is_read_whole_straight_into_its_rows(moe_dir, read_recorder):
    directory = moe_dir("mixtral")
    model = _built(directory)
    load_checkpoint(model, directory, progress=False)
    layer0 = [key for key in read_recorder.keys if key.startswith("model.layers.0.block_sparse_moe.experts.")]
    # every expert tensor of the layer read once (the parts are final tensors' rows, so they may be read ahead,
    # two at a time: the order between them is the read-ahead threads')
    assert sorted(layer0) == sorted(f"model.layers.0.block_sparse_moe.experts.{e}.w{w}.weight"
                                    for e in range(4) for w in (1, 2, 3))
    assert read_recorder.rows == []  # each part whole, with its one read


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_the_stacks_the_mapping_declares_are_those_its_operations_build(moe_dir, family, monkeypatch):
    """The fused experts' layout is declared from transformers' operations (MergeModulelist, Concatenate), not probed
    (a probe of a real model's experts would hold them whole): here the declaration is checked against a probe at
    the real shapes, which runs transformers' own operations on a distinct number in every position."""
    from lightning_lowmem.plan import combine as combine_module
    from lightning_lowmem.plan.combine import with_stacks
    from lightning_lowmem.plan.conversions import find_conversion

    directory = moe_dir(family)
    model = _built(directory)
    with Checkpoint.open(directory) as ckpt:
        monkeypatch.setattr(combine_module, "PROBE_ELEMENTS", 0)  # nothing probed: what is a stack is declared
        combine = find_conversion(model, ckpt.records, ckpt).combine
        monkeypatch.undo()
        probed = with_stacks(dataclasses.replace(combine, stacks={}), ckpt.records)
    assert set(combine.stacks) == set(combine.sources) == set(EXPERTS)
    assert combine.stacks == probed.stacks


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("extra", ["fused beside per-expert", "per-expert beside fused"])
@pytest.mark.parametrize("strict", [True, False])
def test_a_layer_held_both_fused_and_per_expert_is_refused_naming_both_keys(tmp_path, moe_dir, read_recorder, family,
                                                                           extra, strict):
    """Layer 0's experts twice: as transformers' fused ``gate_up_proj`` and as one tensor per expert. Which copy wins
    would be a guess (they may differ): refused before any read, naming the fused key and the per-expert keys."""
    from safetensors.torch import load_file, save_file

    directory = moe_dir(family)
    per_expert = load_file(directory / "model.safetensors")
    model = _built(directory)
    load_checkpoint(model, directory, progress=False)
    fused = {k: v.contiguous() for k, v in model.state_dict().items()}
    if extra == "fused beside per-expert":
        key = "model.layers.0.mlp.experts.gate_up_proj"
        state = {**per_expert, key: fused[key]}
    else:
        state = {**fused, **{k: v for k, v in per_expert.items() if ".layers.0." in k and ".experts." in k}}
    save_file(state, tmp_path / "model.safetensors")
    read_recorder.calls.clear()
    twice = r"holds \d module tensors twice.*'model\.layers\.0\.mlp\.experts\.gate_up_proj' and 'model\.layers\.0\."
    with pytest.raises(CheckpointMismatchError, match=twice + r"[a-z_]+\.experts\.0\."):
        load_checkpoint(_built(directory), tmp_path / "model.safetensors", strict=strict, progress=False)
    assert read_recorder.calls == []


def test_a_checkpoint_holding_fused_experts_is_read_as_it_is(tmp_path, moe_dir, forward_logits):
    from safetensors.torch import save_file

    directory = moe_dir("qwen3_moe")
    model = _built(directory)
    load_checkpoint(model, directory, progress=False)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")

    again = _built(directory)
    report = load_checkpoint(again, tmp_path / "model.safetensors", progress=False)
    assert report.conversion == ""
    assert torch.equal(forward_logits(again), forward_logits(model))


def test_nf4_quantize_on_load_quantizes_the_experts(moe_dir, hf_from_pretrained, quantize_after_load,
                                                    forward_logits):
    """The experts are quantized as bitsandbytes quantizes a parameter that is no Linear weight (its own
    ``replace_parameter_4bit``, made for MoE experts): the same codes and scales, the same logits."""
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    directory = moe_dir("mixtral")
    model = _built(directory, dtype=torch.bfloat16)
    report = load_checkpoint(model, directory, dtype=torch.bfloat16, quantize="bnb.nf4", progress=False)

    assert all(report.quantized[name] == "bnb.nf4" for name in EXPERTS)
    reference = quantize_after_load(hf_from_pretrained(directory, torch.bfloat16), "bnb.nf4").eval()
    full_precision = forward_logits(hf_from_pretrained(directory, torch.bfloat16))
    for name in EXPERTS:
        module_name, leaf = name.rsplit(".", 1)
        replace_parameter_4bit(reference.get_submodule(module_name), leaf, quant_type="nf4", blocksize=64)
        ours = model.get_submodule(module_name).parametrizations[leaf]
        theirs = reference.get_submodule(module_name).parametrizations[leaf]
        assert ours.original.dtype == torch.uint8 and torch.equal(ours.original, theirs.original), name
        assert torch.equal(ours[0].quant_state.absmax, theirs[0].quant_state.absmax), name
    experts = model.model.layers[0].mlp.experts
    shapes = [(4, 256, 64), (4, 64, 128)]
    assert module_nbytes(experts) == sum(BnbNF4().stored_nbytes(s) for s in shapes)  # the scheme's size is the library's
    logits = forward_logits(model)
    assert torch.equal(logits, forward_logits(reference))
    assert torch.nn.functional.cosine_similarity(logits.flatten(), full_precision.flatten(), dim=0) > 0.9


def test_quantized_experts_are_not_saved_half(tmp_path, moe_dir):
    """Their scales live in bitsandbytes' parametrization: a save refuses rather than write the codes alone."""
    directory = moe_dir("mixtral")
    model = _built(directory, dtype=torch.bfloat16)
    load_checkpoint(model, directory, dtype=torch.bfloat16, quantize="bnb.nf4", progress=False)
    with pytest.raises(UnsupportedQuantizationError, match=r"experts\.gate_up_proj.*parametrization.*nothing was"):
        save_checkpoint(model, tmp_path / "saved")
    assert not (tmp_path / "saved").exists() or not any((tmp_path / "saved").iterdir())


def test_a_scheme_with_no_quantized_experts_leaves_them_in_full_precision_and_says_why(moe_dir):
    directory = moe_dir("qwen3_moe")
    model = _built(directory, dtype=torch.bfloat16)
    report = load_checkpoint(model, directory, dtype=torch.bfloat16, quantize="torchao.int8wo", progress=False)
    assert not set(EXPERTS) & set(report.quantized)
    assert all("no quantized form of a 3-D stack of expert weights" in report.left_out[name] for name in EXPERTS)
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16


@pytest.fixture
def llama_dir(tmp_path):
    """A tiny Llama written by ``save_pretrained``, and its model."""
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    return tmp_path, model


@pytest.fixture
def llama_mapping(monkeypatch):
    """``llama_mapping(entries)``: transformers' conversion mapping for ``llama`` replaced by ``entries`` for the test,
    as a family transformers adds would register it."""
    from transformers import conversion_mapping

    conversion_mapping.get_checkpoint_conversion_mapping("llama")  # builds transformers' cache
    return lambda entries: monkeypatch.setitem(conversion_mapping._checkpoint_conversion_mapping_cache, "llama",
                                               entries)


def test_any_operation_transformers_registers_is_run_by_its_own_code(llama_dir, llama_mapping, forward_logits):
    """A family transformers adds converts with no line here: a weight stored transposed, under another name."""
    from safetensors.torch import load_file, save_file
    from transformers.core_model_loading import Transpose, WeightConverter

    directory, reference = llama_dir
    state = load_file(directory / "model.safetensors")
    for i in range(2):
        state[f"model.layers.{i}.mlp.down_proj.weight_t"] = state.pop(f"model.layers.{i}.mlp.down_proj.weight").t()
    save_file({k: v.contiguous() for k, v in state.items()}, directory / "model.safetensors")
    llama_mapping([WeightConverter("mlp.down_proj.weight_t", "mlp.down_proj.weight", operations=[Transpose(0, 1)])])

    model = _built(directory)
    report = load_checkpoint(model, directory, progress=False)
    assert "Transpose" in report.conversion
    assert torch.equal(forward_logits(model), forward_logits(reference))


def test_an_operation_making_several_tensors_from_one_is_refused_before_any_read(llama_dir, llama_mapping,
                                                                                 read_recorder):
    from safetensors.torch import load_file, save_file
    from transformers.core_model_loading import Chunk, WeightConverter

    directory, _ = llama_dir
    state = load_file(directory / "model.safetensors")
    for i in range(2):
        q, k, v = (state.pop(f"model.layers.{i}.self_attn.{p}_proj.weight") for p in "qkv")
        state[f"model.layers.{i}.self_attn.qkv.weight"] = torch.cat([q, q, q])  # equal thirds, as Chunk splits
    save_file({k: v.contiguous() for k, v in state.items()}, directory / "model.safetensors")
    llama_mapping([WeightConverter("self_attn.qkv.weight", ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                            "self_attn.v_proj.weight"], operations=[Chunk(0)])])

    with pytest.raises(CheckpointMismatchError, match=r"'llama' checkpoint.*with Chunk.*does not stream"):
        load_checkpoint(_built(directory), directory, progress=False)
    assert read_recorder.calls == []
