"""A tensor stacked from its parts (transformers' fused MoE experts from one checkpoint tensor per expert): each part
read once, straight into its rows of the tensor, which is allocated once; quantized a block of rows at a time;
DTensor shards filled with this rank's experts only.

Peak memory (fresh process, 2-core CPU, torch 2.13): a 4-layer Mixtral of 8 experts (hidden 1024, 226 MiB in bf16; each
layer's fused gate_up_proj 32 MiB, built from 16 parts of 2 MiB) loaded in bf16 peaked at the final model + 0.4-1.0 MiB
on the stacked route, and at the final model + 51-129 MiB with its parts combined as before (the parts and the
stacked intermediates of transformers' MergeModulelist beside the result). bnb.nf4 of the same checkpoint peaked at the
quantized model + 24 MiB (its estimate: + 49 MiB). The bound below is the final model + one part + 16 MiB.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lightning_lowmem import LoadOptions, init_empty, load_checkpoint
from lightning_lowmem.engine import prepare_load, resolved
from lightning_lowmem.routes.route import Traits
from lightning_lowmem.routes.choice import route_of

transformers = pytest.importorskip("transformers")

MiB = 2**20
MARGIN = 16 * MiB


def _meta_model(directory, dtype: torch.dtype = torch.float32):
    config = transformers.AutoConfig.from_pretrained(directory)
    with init_empty():
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory, write_moe_dir):
    directory = tmp_path_factory.mktemp("mixtral")
    write_moe_dir(directory, "mixtral")
    return directory


@pytest.mark.parametrize(("quantize", "kind"), [(None, "stacked"), ("bnb.nf4", "stacked rows")])
def test_fused_experts_take_the_stacked_routes(mixtral_dir, quantize, kind):
    model = _meta_model(mixtral_dir, torch.bfloat16)
    options = LoadOptions(dtype=torch.bfloat16, quantize=quantize)
    with resolved(mixtral_dir, model, options) as source:
        prepared = prepare_load(model, source, options)
        traits = Traits.of(prepared.plan, source.checkpoint, transform=False)
        routes = {t.names[0]: route_of(t, traits) for t in prepared.plan.targets}
    experts = {name: route for name, route in routes.items() if ".experts." in name}
    assert len(experts) == 4 and {route.kind for route in experts.values()} == {kind}
    gate_up = experts["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.target.stack.tail == (64,) and len(gate_up.target.parts) == 8  # w1 and w3 of 4 experts
    assert gate_up.read_nbytes == sum(p.nbytes for p in gate_up.target.parts)  # each part read once
    if quantize is None:  # cast from the file's fp32 into bf16: one part at a time, through the scratch buffer
        part = gate_up.target.parts[0].tensor_nbytes
        assert gate_up.transient == part and gate_up.scratch_nbytes == part


def test_a_transform_on_the_whole_tensor_builds_it_from_its_parts(mixtral_dir):
    model = _meta_model(mixtral_dir)
    options = LoadOptions()
    with resolved(mixtral_dir, model, options) as source:
        prepared = prepare_load(model, source, options)
        traits = Traits.of(prepared.plan, source.checkpoint, transform=True)
        kinds = {route_of(t, traits).kind for t in prepared.plan.targets if t.stack is not None}
    assert kinds == {"combined"}


FSDP_LOAD = """
import transformers
from lightning_lowmem import init_empty, load_checkpoint
from lightning_lowmem.placement import shard_model
path = args["path"]
config = transformers.AutoConfig.from_pretrained(path)

def build():
    with init_empty():
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()

stored = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()  # fp32, as in the file
model = shard_model(build(), mesh)
report = load_checkpoint(model, path, progress=False)
mismatched, share, expert_share = [], 0, 0
for name, param in model.named_parameters():
    chunks = torch.chunk(stored[name], world)
    want = chunks[rank] if rank < len(chunks) else stored[name][:0]
    share += want.nbytes
    expert_share += want.nbytes if ".experts." in name else 0
    if not torch.equal(param.to_local(), want.to(torch.bfloat16)):
        mismatched.append(name)
single = build()
load_checkpoint(single, path, progress=False)
tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    same = torch.equal(model(tokens).logits, single(tokens).logits)
emit(mismatched=mismatched, bytes_read=report.bytes_read, share=share, expert_share=expert_share,
     conversion=report.conversion, logits_equal=same)
"""


@pytest.mark.slow
def test_fused_experts_fill_fsdp2_shards_each_rank_reading_only_its_experts(run_ranks, tmp_path, write_moe_dir):
    """3 experts on 2 ranks: 2 and 1 (FSDP2 pads the second rank's shard); the fp32 file cast into bf16 shards."""
    write_moe_dir(tmp_path, "mixtral", num_local_experts=3)
    ranks = run_ranks(FSDP_LOAD, dict(path=str(tmp_path)))
    for result in ranks:
        assert result.returncode == 0, result.stderr[-3000:]
        got = result.values
        assert got["mismatched"] == [], result.rank
        assert got["bytes_read"] == got["share"], result.rank  # its own experts' rows, nothing else
        assert got["conversion"].startswith("transformers' conversion mapping (mixtral")
        assert got["logits_equal"], result.rank
    assert ranks[0].values["expert_share"] == 2 * ranks[1].values["expert_share"]  # experts 0, 1 | expert 2


PEAK = """
import json, sys, torch, transformers, warnings
warnings.filterwarnings("ignore")
import bitsandbytes  # imported before the measurement: its import is not the load's
from lightning_lowmem import LoadOptions, init_empty, load_checkpoint
from lightning_lowmem.engine import estimate_prepared, prepare_load, resolved
path, mode = sys.argv[1], sys.argv[2]
if mode == "combined":  # the contrast: the same load with the parts combined, as a Combine builds a tensor
    import lightning_lowmem.routes.choice
    lightning_lowmem.routes.choice.stackable = lambda *args: False
config = transformers.AutoConfig.from_pretrained(path)
with init_empty():
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
options = LoadOptions(dtype=torch.bfloat16, quantize="bnb.nf4" if mode == "nf4" else None, progress=False)
with resolved(path, model, options) as source:
    est = estimate_prepared(prepare_load(model, source, options), model="moe", dtype=torch.bfloat16, batch_size=1,
                            max_seq_length=1, prompt_length=1, with_caches=False)
report = load_checkpoint(model, path, options=options)
print(json.dumps({"peak": report.memory.rss_peak_delta, "final": report.bytes_loaded,
                  "estimate": est.weights + est.load_transient, "quantized": len(report.quantized)}))
"""


@pytest.fixture(scope="module")
def large_moe(tmp_path_factory, write_moe_dir):
    """A 4-layer Mixtral of 8 experts, hidden 1024 (226 MiB in bf16), saved in bf16 by ``save_pretrained``; each
    layer's gate_up_proj is 32 MiB built from 16 parts of 2 MiB."""
    directory = tmp_path_factory.mktemp("large-moe")
    write_moe_dir(directory, "mixtral", hidden=1024, layers=4, dtype=torch.bfloat16, vocab_size=1024,
                  intermediate_size=1024, num_local_experts=8, num_attention_heads=8)
    return directory


def _peak(child_env, directory, mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PEAK, str(directory), mode], capture_output=True, text=True,
                          env=child_env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_stacked_peak_is_the_final_model_plus_about_one_part(large_moe, child_env):
    part, fused = 1024 * 1024 * 2, 8 * 2048 * 1024 * 2
    stacked = _peak(child_env, large_moe, "stacked")
    combined = _peak(child_env, large_moe, "combined")
    print({k: round((v["peak"] - v["final"]) / MiB, 1) for k, v in (("stacked", stacked), ("combined", combined))})
    assert stacked["final"] > 200 * MiB
    assert stacked["peak"] <= stacked["final"] + part + MARGIN
    assert combined["peak"] >= combined["final"] + fused  # the measurement tells a stacked load from a combined one
    assert stacked["peak"] <= stacked["estimate"]  # the estimate asks the same route


@pytest.mark.slow
def test_quantized_experts_are_never_whole_in_full_precision(large_moe, child_env):
    result = _peak(child_env, large_moe, "nf4")
    assert result["quantized"] == 4 * 4 + 4 * 2  # q, k, v, o and the two expert stacks of each layer
    assert result["peak"] <= result["final"] + 64 * MiB  # measured + 24 MiB; a fused bf16 stack alone is 32 MiB
    assert result["peak"] <= result["estimate"]
