"""Loading checkpoints that hold weights already quantized, as transformers' ``save_pretrained`` writes them.

Each directory (the ``hf_prequantized`` fixture) is a tiny Llama loaded by transformers with its own
quantization config on CPU and saved again. The reference is transformers' own ``from_pretrained`` of the
same directory in the same dtype: the same library kernels on the same stored tensors, so the logits must be equal.
(Without a dtype transformers 4 loads the rest of a bitsandbytes model in float16, whatever the model was built in.)
"""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_lowmem import CheckpointFormatError, CheckpointMismatchError, load_checkpoint
from lightning_lowmem.meta import meta_tensor_names
from lightning_lowmem.quantize import BnbNF4

SCHEMES = ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8", "torchao.int8wo", "torchao.int8dq"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_transformers_checkpoint_loads_as_stored(hf_prequantized, meta_hf_model, hf_from_pretrained, forward_logits,
                                                 read_recorder, scheme):
    directory = hf_prequantized(scheme)
    model = meta_hf_model(directory)
    report = load_checkpoint(model, directory, progress=False)

    linears = {f"model.layers.{i}.{m}" for i in range(2) for m in
               ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")}
    assert report.prequantized == report.quantized == dict.fromkeys(linears, scheme)
    assert report.requantized == {} and report.quantized_bytes_before == 0  # nothing was quantized
    assert report.left_out == {"lm_head": "stored in full precision in the checkpoint"}
    assert f"loaded 14 modules quantized as stored ({scheme})" in str(report)
    assert not read_recorder.rows  # every stored tensor read as it is, none by blocks of rows to quantize
    reference = hf_from_pretrained(directory, torch.bfloat16)  # the dtype the model was built in
    torch.testing.assert_close(forward_logits(model), forward_logits(reference), rtol=0, atol=0)


@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.int8", "torchao.int8wo"])
def test_quantize_naming_the_files_scheme_is_accepted(hf_prequantized, meta_hf_model, scheme):
    directory = hf_prequantized(scheme)
    report = load_checkpoint(meta_hf_model(directory), directory, quantize=scheme, progress=False)
    assert set(report.prequantized.values()) == {scheme} and not report.requantized


@pytest.mark.parametrize(("stored", "asked"), [("bnb.nf4", "bnb.int8"), ("bnb.nf4", "bnb.nf4-dq"),
                                                ("bnb.int8", "torchao.int8wo"), ("torchao.int8wo", "torchao.int8dq")])
def test_a_quantize_the_file_disagrees_with_fails_before_any_read(hf_prequantized, meta_hf_model, read_recorder,
                                                                  stored, asked):
    directory = hf_prequantized(stored)
    model = meta_hf_model(directory)
    with pytest.raises(CheckpointMismatchError, match=f"already quantized as {stored} .*quantize='{asked}'") as e:
        load_checkpoint(model, directory, quantize=asked, progress=False)
    assert "nothing was read" in str(e.value) and "pass quantize=None" in str(e.value)
    assert read_recorder.calls == []
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear and meta_tensor_names(model)


def test_a_scheme_object_with_other_options_than_the_file_fails_before_any_weight(hf_prequantized, meta_hf_model,
                                                                                  read_recorder):
    directory = hf_prequantized("bnb.nf4")
    with pytest.raises(CheckpointMismatchError, match=r"stored as BnbNF4\(.*blocksize=64.*quantize=BnbNF4\(.*128"):
        load_checkpoint(meta_hf_model(directory), directory, quantize=BnbNF4(blocksize=128), progress=False)
    assert all(".quant_state." in key for key in read_recorder.keys)  # only quant states, to learn the block size


def _rewrite(directory, tmp_path, edit) -> None:
    """``directory``'s files copied into ``tmp_path``, ``edit(tensors)`` applied to its weights file."""
    for path in directory.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})


@pytest.mark.parametrize("damage", ["absmax-shape", "json", "json-shape", "quant-map-dtype"])
def test_a_damaged_4bit_quant_state_is_a_typed_error_naming_the_key(hf_prequantized, meta_hf_model, read_recorder,
                                                                    tmp_path, damage):
    directory = hf_prequantized("bnb.nf4-dq")
    key = "model.layers.1.mlp.up_proj.weight"

    def edit(tensors):
        if damage == "absmax-shape":
            tensors[f"{key}.absmax"] = tensors[f"{key}.absmax"][:-1].clone()
        elif damage == "quant-map-dtype":
            tensors[f"{key}.quant_map"] = tensors[f"{key}.quant_map"].half()
        else:
            state = f"{key}.quant_state.bitsandbytes__nf4"
            text = b'{"quant_type": "nf4", "blocks' if damage == "json" else json.dumps(
                {**json.loads(bytes(tensors[state].tolist())), "shape": [3, -1]}).encode()
            tensors[state] = torch.tensor(list(text), dtype=torch.uint8)

    _rewrite(directory, tmp_path, edit)
    model = meta_hf_model(tmp_path)
    named = {"absmax-shape": f"{key}.absmax", "quant-map-dtype": f"{key}.quant_map"}.get(
        damage, f"{key}.quant_state.bitsandbytes__nf4")
    with pytest.raises(CheckpointFormatError, match=named.replace(".", r"\.")) as e:
        load_checkpoint(model, tmp_path, progress=False)
    assert "download or save it again" in str(e.value)
    assert all(".quant_state." in k for k in read_recorder.keys)  # found before any weight was read
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear and meta_tensor_names(model)


def test_damaged_int8_scales_and_torchao_metadata_are_typed_errors(hf_prequantized, meta_hf_model, read_recorder,
                                                                   tmp_path):
    key = "model.layers.0.self_attn.k_proj"
    _rewrite(hf_prequantized("bnb.int8"), tmp_path, lambda t: t.update({f"{key}.SCB": t[f"{key}.SCB"][:3].clone()}))
    with pytest.raises(CheckpointFormatError, match=rf"{key}\.SCB.*needs float32 \[64\]"):
        load_checkpoint(meta_hf_model(tmp_path), tmp_path, progress=False)

    damaged = tmp_path / "torchao"
    damaged.mkdir()
    for path in hf_prequantized("torchao.int8wo").iterdir():
        (damaged / path.name).write_bytes(path.read_bytes())
    weights = damaged / "model.safetensors"
    data = weights.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    header["__metadata__"][f"{key}.weight"] = '{"_type": "Int8Tensor", '
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    weights.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + size:])
    with pytest.raises(CheckpointFormatError, match=rf"metadata '{key}\.weight' is not valid JSON"):
        load_checkpoint(meta_hf_model(damaged), damaged, progress=False)
    assert all(k.endswith(".weight_format") for k in read_recorder.keys)  # int8's one-element flags, no weight


def test_estimate_and_placement_count_the_stored_bytes(hf_prequantized, meta_hf_model):
    from lightning_lowmem import placement_plan

    directory = hf_prequantized("bnb.nf4")
    plan = placement_plan(meta_hf_model(directory), directory, {"cpu": "1GiB"})
    model = meta_hf_model(directory)
    report = load_checkpoint(model, directory, progress=False)
    buffers = sum(b.nbytes for b in model.buffers())  # rotary tables, built by the model, not in the plan
    assert sum(plan.weights_per_device().values()) == report.bytes_loaded - buffers


def _edit_metadata(source, destination, edit) -> None:
    """``source``'s files copied into ``destination``, ``edit(metadata)`` applied to its weights file's header."""
    destination.mkdir()
    for path in source.iterdir():
        (destination / path.name).write_bytes(path.read_bytes())
    weights = destination / "model.safetensors"
    data = weights.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    edit(header["__metadata__"])
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    weights.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + size:])


DTYPE = {"_type": "torch.dtype", "_data": "bfloat16"}
PER_TENSOR = {"_type": "QuantizeTensorToInt8Kwargs", "_data": {"granularity": {"_type": "PerTensor", "_data": {}},
                                                                "mapping_type": {"_type": "MappingType",
                                                                                 "_data": "SYMMETRIC"},
                                                                "reduce_range": False}}
TORCHAO_EDITS = {  # name -> (the scheme saved, the key named, edit of the weight's metadata)
    "act-quant-a-dtype": ("torchao.int8wo", "act_quant_kwargs", lambda m: m["_data"].update(act_quant_kwargs=DTYPE)),
    "act-quant-a-bare-dict": ("torchao.int8wo", "act_quant_kwargs", lambda m: m["_data"].update(act_quant_kwargs={})),
    "act-quant-5": ("torchao.int8wo", "act_quant_kwargs", lambda m: m["_data"].update(act_quant_kwargs=5)),
    "act-quant-per-tensor": ("torchao.int8dq", "act_quant_kwargs",
                             lambda m: m["_data"].update(act_quant_kwargs=PER_TENSOR)),
    "reduce-range": ("torchao.int8wo", "reduce_range", lambda m: m["_data"].update(reduce_range="yes")),
    "dtype-type": ("torchao.int8wo", "dtype", lambda m: m["_data"].update(dtype={"_type": "str", "_data": "bfloat16"})),
    "an-unknown-field": ("torchao.int8wo", "evil", lambda m: m["_data"].update(evil=1)),
    "data-names": ("torchao.int8wo", "_tensor_data_names", lambda m: m.update(_tensor_data_names=["qdata", "scale"])),
    "a-list-for-data": ("torchao.int8wo", "_data", lambda m: m.update(_data=[1, 2])),
}


@pytest.mark.parametrize("edit", TORCHAO_EDITS)
def test_torchao_metadata_other_than_what_is_written_is_refused_by_key_before_any_read(
        hf_prequantized, meta_hf_model, read_recorder, tmp_path, edit):
    """Every field of the metadata torchao's Int8Tensor is rebuilt from is checked against what a save writes; a
    tampered act_quant_kwargs used to load (taken as int8dq) and fail at the first forward with torch's raw error."""
    scheme, named, change = TORCHAO_EDITS[edit]
    key = "model.layers.0.self_attn.k_proj.weight"

    def tamper(metadata):
        info = json.loads(metadata[key])
        change(info)
        metadata[key] = json.dumps(info)

    _edit_metadata(hf_prequantized(scheme), tmp_path / "tampered", tamper)
    model = meta_hf_model(tmp_path / "tampered")
    with pytest.raises(CheckpointFormatError, match=rf"{key}.*{named}") as e:
        load_checkpoint(model, tmp_path / "tampered", progress=False)
    assert "save it again" in str(e.value)
    assert read_recorder.calls == [] and meta_tensor_names(model)


BNB_EDITS = {  # name -> (the scheme saved, the field named, edit of the quant state)
    "an-unknown-field": ("bnb.nf4", "evil", lambda s: s.update(evil=1)),
    "nested-fields-without-nesting": ("bnb.nf4", "nested_offset", lambda s: s.update(nested_offset=0.5)),
    "nested-offset-nan": ("bnb.nf4-dq", "nested_offset", lambda s: s.update(nested_offset=float("nan"))),
    "nested-blocksize": ("bnb.nf4-dq", "nested_blocksize", lambda s: s.update(nested_blocksize=3)),
    "nested-dtype": ("bnb.nf4-dq", "nested_dtype", lambda s: s.update(nested_dtype="int8")),
}


@pytest.mark.parametrize("edit", BNB_EDITS)
def test_a_4bit_quant_state_field_other_than_what_is_written_is_refused_by_name_before_any_weight(
        hf_prequantized, meta_hf_model, read_recorder, tmp_path, edit):
    scheme, named, change = BNB_EDITS[edit]
    key = f"model.layers.1.mlp.up_proj.weight.quant_state.bitsandbytes__{scheme[4:7]}"

    def tamper(tensors):
        state = json.loads(bytes(tensors[key].tolist()))
        change(state)
        tensors[key] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)

    _rewrite(hf_prequantized(scheme), tmp_path, tamper)
    model = meta_hf_model(tmp_path)
    with pytest.raises(CheckpointFormatError, match=rf"{re.escape(key)}.*{named}") as e:
        load_checkpoint(model, tmp_path, progress=False)
    assert "save it again" in str(e.value)
    assert all(".quant_state." in k for k in read_recorder.keys) and meta_tensor_names(model)


def test_an_int8_weight_format_other_than_row_major_is_refused_before_any_weight(hf_prequantized, meta_hf_model,
                                                                                 read_recorder, tmp_path):
    key = "model.layers.0.mlp.down_proj.weight_format"
    _rewrite(hf_prequantized("bnb.int8"), tmp_path, lambda t: t.update({key: torch.tensor(1, dtype=torch.uint8)}))
    model = meta_hf_model(tmp_path)
    with pytest.raises(CheckpointFormatError, match=rf"{re.escape(key)}' in .* is 1;"):
        load_checkpoint(model, tmp_path, progress=False)
    assert all(k.endswith(".weight_format") for k in read_recorder.keys) and meta_tensor_names(model)
