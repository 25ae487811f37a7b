"""A model sharded by ``fully_shard`` (FSDP2) on the meta device, loaded on 2 ranks (gloo, CPU): each rank reads only
its rows, straight into its shards, and the sharded model computes what a single-process load computes."""

from __future__ import annotations

import pytest
import torch

SHARDED_LOAD = """
from litgpt import GPT
from lightning_lowmem import init_empty, load_checkpoint
from lightning_lowmem.placement import shard_model

def build():
    torch.set_default_dtype(torch.bfloat16)  # as Fabric's precision="bf16-true" builds it
    try:
        with init_empty():
            return GPT(config())
    finally:
        torch.set_default_dtype(torch.float32)

reference = torch.load(args["reference"], weights_only=True)
tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1))
for kind, path in args["paths"].items():
    model = shard_model(build(), mesh)
    ids = {name: id(p) for name, p in model.named_parameters()}
    report = load_checkpoint(model, path, progress=False)
    same_objects = ids == {name: id(p) for name, p in model.named_parameters()}
    mismatched, share = [], 0
    for name, param in model.named_parameters():
        chunks = torch.chunk(reference[name], world)
        want = chunks[rank] if rank < len(chunks) else reference[name][:0]
        share += want.nbytes
        local = param.to_local()
        if local.dtype != want.dtype or not torch.equal(local, want):
            mismatched.append(name)
    single = build()
    load_checkpoint(single, path, progress=False)
    with torch.no_grad():
        same = torch.equal(model(tokens), single(tokens))
    emit(**{kind: dict(mismatched=mismatched, bytes_read=report.bytes_read, share=share, rank=report.rank,
                       shard_bytes=report.shard_bytes, logits_equal=same, same_objects=same_objects)})

# a DTensor cut by columns (tensor parallelism), and one replicated: read whole, this rank's part kept
from torch.distributed.tensor import DTensor, Replicate, Shard
cols = 256 // world
module = torch.nn.Module()
module.weight = torch.nn.Parameter(DTensor.from_local(torch.empty(101, cols, dtype=torch.bfloat16, device="meta"),
                                                      mesh, [Shard(1)], run_check=False))
module.norm = torch.nn.Parameter(DTensor.from_local(torch.empty(256, dtype=torch.bfloat16, device="meta"), mesh,
                                                    [Replicate()], run_check=False))
names = {"lm_head.weight": "weight", "transformer.ln_f.weight": "norm"}
report = load_checkpoint(module, args["paths"]["safetensors"], key_map=names.get, progress=False)
emit(columns=torch.equal(module.weight.to_local(), reference["lm_head.weight"][:, rank * cols:(rank + 1) * cols]),
     replicated=torch.equal(module.norm.to_local(), reference["transformer.ln_f.weight"]),
     whole_read=report.bytes_read == (101 * 256 + 256) * 2, read_whole=sorted(report.read_whole))
"""


@pytest.fixture(scope="module")
def sharded_checkpoints(tmp_path_factory, shard_config, tiny_gpt, write_checkpoint):
    """The shard config's GPT in bf16 (random weights) as safetensors, a sharded safetensors set and a torch file,
    and its state dict saved by ``torch.save`` as the reference."""
    from litgpt import Config

    state = tiny_gpt(Config(**shard_config), torch.bfloat16, std=0.3).state_dict()
    root = tmp_path_factory.mktemp("sharded")
    paths = {kind: str(write_checkpoint(state, kind, root / kind))
             for kind in ("safetensors", "sharded-safetensors", "pth")}
    torch.save(state, root / "reference.pt")
    return paths, str(root / "reference.pt")


def test_each_rank_reads_exactly_its_rows_into_its_shards(run_ranks, shard_config, sharded_checkpoints):
    """The core test: bit for bit, bytes read, logits (which garbage RoPE buffers would break), parameter objects.

    The vocabulary's 101 rows split unevenly (51 + 50): FSDP2 pads the second rank's shard; it reads its 50 rows.
    """
    paths, reference = sharded_checkpoints
    ranks = run_ranks(SHARDED_LOAD, dict(config=shard_config, paths=paths, reference=reference))
    for result in ranks:
        assert result.returncode == 0, result.stderr[-3000:]
        assert set(result.values) == {*paths, "columns", "replicated", "whole_read", "read_whole"}
        assert result.values["read_whole"] == ["weight"]  # the columns, said before the read; the replica is its own
        for kind, got in ((k, v) for k, v in result.values.items() if k in paths):
            assert got["mismatched"] == [], (result.rank, kind)
            assert got["bytes_read"] == got["share"], (result.rank, kind)  # only its own rows
            assert got["shard_bytes"] >= got["share"]  # the padded shards hold at least what was read
            assert got["rank"] == result.rank
            assert got["logits_equal"], (result.rank, kind)
            assert got["same_objects"], (result.rank, kind)  # FSDP's own parameters, filled in place
        assert result.values["columns"] and result.values["replicated"] and result.values["whole_read"]
    total = sum(v.nbytes for v in torch.load(reference, weights_only=True).values())
    assert sum(r.values["safetensors"]["bytes_read"] for r in ranks) == total  # together, the file once


HF_SHARDED = """
from litgpt import GPT, Config
from lightning_lowmem import init_empty, load_checkpoint
from lightning_lowmem.placement import shard_model

reference = torch.load(args["reference"], weights_only=True)
with init_empty():
    model = GPT(Config.from_file(args["config_file"]))
model = shard_model(model, mesh)
report = load_checkpoint(model, args["path"], dtype=torch.float32, progress=False)
mismatched, share = [], 0
for name, param in model.named_parameters():
    chunks = torch.chunk(reference[name], world)
    want = chunks[rank] if rank < len(chunks) else reference[name][:0]
    share += want.nbytes
    if not torch.equal(param.to_local(), want):
        mismatched.append(name)
emit(mismatched=mismatched, read_whole=sorted(report.read_whole), bytes_read=report.bytes_read, share=share,
     conversion=report.conversion)
"""


def test_an_hf_checkpoint_into_a_sharded_gpt_reads_each_ranks_rows_of_the_fused_qkv(run_ranks, tmp_path,
                                                                                     write_hf_dir, litgpt_converted):
    """q, k and v (HF) into litgpt's qkv, interleaved by query group, sharded by rows across 2 ranks: each rank reads
    only the runs of q, k and v rows its shard holds, and holds what litgpt's own conversion gives."""
    _, config = write_hf_dir(tmp_path / "hf", "llama-gqa", tokenizer=False)
    reference = litgpt_converted(tmp_path / "hf", config, tmp_path / "converted") / "lit_model.pth"
    ranks = run_ranks(HF_SHARDED, dict(path=str(tmp_path / "hf"), reference=str(reference),
                                       config_file=str(tmp_path / "hf" / "model_config.yaml")))
    for result in ranks:
        assert result.returncode == 0, result.stderr[-3000:]
        got = result.values
        assert got["conversion"].startswith("HF -> litgpt")
        assert got["mismatched"] == [] and got["read_whole"] == [], (result.rank, got)
        assert got["bytes_read"] == got["share"], result.rank  # only its own rows, q, k and v included
