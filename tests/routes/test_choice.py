"""One route per target: decided once, from the target, its scheme, the transform and the checkpoint; the stream
reads along it and the estimate counts what it holds, so the two cannot drift apart."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem import LoadOptions, load_checkpoint
from lightning_lowmem.engine import LOAD_RUNTIME, estimate_prepared, prepare_load, resolved
from lightning_lowmem.routes.route import Traits
from lightning_lowmem.routes.choice import route_of
from lightning_lowmem.engine.stream import mappable
from lightning_lowmem.quantize.quantizer import TRIM_AT


def _routes(model, path, options: LoadOptions):
    """Each target's route as the stream decides it, and the estimate of the same prepared load."""
    with resolved(path, model, options) as source:
        prepared = prepare_load(model, source, options)
        mapped = bool(options.mmap) and prepared.selection is None and mappable(prepared.plan, None,
                                                                                prepared.transform)
        traits = Traits.of(prepared.plan, source.checkpoint, transform=prepared.transform, mapped=mapped)
        routes = {t.names[0]: route_of(t, traits) for t in prepared.plan.targets}
    estimate = estimate_prepared(prepared, model="m", dtype=torch.bfloat16, batch_size=1, max_seq_length=1,
                                 prompt_length=1, with_caches=False)
    return routes, estimate


CASES = {  # options -> the route of an attention weight, and of a norm
    "as stored": (dict(), "whole", "whole"),
    "mapped": (dict(mmap=True), "mapped", "mapped"),
    "cast": (dict(dtype=torch.bfloat16), "whole", "whole"),
    "bnb.nf4": (dict(dtype=torch.bfloat16, quantize="bnb.nf4"), "rows", "whole"),
    "torchao.int8wo": (dict(dtype=torch.bfloat16, quantize="torchao.int8wo"), "rows", "whole"),
    "transform": (dict(dtype=torch.bfloat16, quantize="bnb.nf4", transform=lambda name, t: t), "whole", "whole"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_stream_reads_along_the_routes_the_estimate_counts(tmp_path, quant_config, tiny_gpt, meta_gpt,
                                                               write_checkpoint, case):
    kwargs, weight_route, norm_route = CASES[case]
    path = write_checkpoint(tiny_gpt(quant_config).state_dict(), "safetensors", tmp_path)
    options = LoadOptions(progress=False, **kwargs)
    routes, estimate = _routes(meta_gpt(quant_config), path, options)

    assert routes["transformer.h.0.attn.qkv.weight"].kind == weight_route
    assert routes["transformer.h.0.norm_1.weight"].kind == norm_route
    report = load_checkpoint(meta_gpt(quant_config), path, options=options)
    assert report.bytes_read == sum(route.read_nbytes for route in routes.values())
    assert estimate.load_transient == max(route.transient for route in routes.values()) + LOAD_RUNTIME


def test_route_sizes(tmp_path, quant_config, tiny_gpt, meta_gpt, write_checkpoint):
    """What each route holds beyond the final tensor, as ``engine/memory_estimate.py`` states it."""
    path = write_checkpoint(tiny_gpt(quant_config).state_dict(), "safetensors", tmp_path)  # fp32
    routes, _ = _routes(meta_gpt(quant_config), path, LoadOptions(dtype=torch.bfloat16, quantize="bnb.nf4"))
    norm, qkv = routes["transformer.h.0.norm_1.weight"], routes["transformer.h.0.attn.qkv.weight"]
    assert norm.transient == 128 * 4 and norm.scratch_nbytes == 128 * 4  # the fp32 tensor as read, beside its cast
    numel = 3 * 128 * 128  # a block of rows as read (fp32), cast (bf16) and quantized (14.3 bytes per element)
    working = int(numel * (4 + 2 + qkv.target.scheme.transient))
    assert qkv.transient == working + TRIM_AT  # the freed heap a trim leaves: up to TRIM_AT
    assert qkv.scratch_nbytes == 0 and not qkv.final


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2.5", "gemma", "olmo-2"])
def test_parts_reordered_by_rows_are_read_into_place(tmp_path, write_hf_dir, meta_gpt, family):
    """An HF checkpoint's q, k and v into litgpt's fused qkv, interleaved by query group:
    a stack of runs of rows, each read straight into its place (nothing held beside the tensor)."""
    _, config = write_hf_dir(tmp_path, family)
    routes, _ = _routes(meta_gpt(config), tmp_path, LoadOptions())
    qkv = routes["transformer.h.0.attn.qkv.weight"]
    assert qkv.kind == "stacked" and qkv.target.stack is not None
    assert qkv.transient == 0 and qkv.final
    assert qkv.read_nbytes == sum(p.nbytes for p in qkv.target.parts)


def test_parts_combined_hold_the_parts(tmp_path, write_hf_dir, meta_gpt):
    """Phi-3's fused gate_up_proj feeds two litgpt tensors (fc_1 and fc_2): read once, held for both, and each
    combined from it."""
    _, config = write_hf_dir(tmp_path, "phi-3")
    routes, _ = _routes(meta_gpt(config), tmp_path, LoadOptions())
    fc_1 = routes["transformer.h.0.mlp.fc_1.weight"]
    assert fc_1.kind == "combined"
    assert fc_1.transient == sum(p.tensor_nbytes for p in fc_1.target.parts)
    assert fc_1.read_nbytes == sum(p.nbytes for p in fc_1.target.parts)


def test_weights_stored_quantized_are_read_as_stored(hf_prequantized, meta_hf_model):
    directory = hf_prequantized("bnb.nf4")
    routes, _ = _routes(meta_hf_model(directory), directory, LoadOptions())
    q_proj = routes["model.layers.0.self_attn.q_proj.weight"]
    assert q_proj.kind == "stored" and q_proj.transient == 0  # on CPU the parts read are the final tensors


def test_a_tensor_cast_on_its_way_is_built_a_block_of_rows_at_a_time(tmp_path):
    """A float32 tensor loaded in bf16, larger than a block: cast a block of rows at a time into the final tensor,
    never whole in float32 beside its cast copy; a smaller one is read whole; the values are the eager cast's."""
    from safetensors.torch import save_file
    from torch import nn

    from lightning_lowmem import init_empty
    from lightning_lowmem.quantize.rows import CHUNK_ELEMENTS

    torch.manual_seed(0)
    source = nn.Sequential(nn.Embedding(4 * CHUNK_ELEMENTS // 64, 64), nn.Linear(64, 64))
    save_file(source.state_dict(), tmp_path / "fp32.safetensors")
    with init_empty():
        model = nn.Sequential(nn.Embedding(4 * CHUNK_ELEMENTS // 64, 64), nn.Linear(64, 64))
    routes, estimate = _routes(model, tmp_path / "fp32.safetensors", LoadOptions(dtype=torch.bfloat16))
    embedding = routes["0.weight"]
    assert embedding.kind == "built rows" and routes["1.weight"].kind == "whole"
    assert embedding.transient == CHUNK_ELEMENTS * 4  # one block as read (float32), not the whole tensor
    load_checkpoint(model, tmp_path / "fp32.safetensors", dtype=torch.bfloat16, progress=False)
    assert torch.equal(model[0].weight, source[0].weight.to(torch.bfloat16))
    assert model[0].weight.dtype == torch.bfloat16
