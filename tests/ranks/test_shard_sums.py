"""``torchao.nf4`` under FSDP2 on 2 ranks (gloo, CPU): each rank reads only its rows of every weight and quantizes them
alone, the whole weight's one statistic agreed by an all-reduce; a rank that fails mid-stream stops the other at that
all-reduce instead of leaving it waiting."""

from __future__ import annotations

import pytest
import torch

NF4_BY_ROWS = """
from litgpt import GPT
from lightning_lowmem import LoadOptions, init_empty, load_checkpoint
from lightning_lowmem.engine import quantize_for_sharding
from lightning_lowmem.routes.reader import Reader
from lightning_lowmem.placement import shard_model
from lightning_lowmem.quantize.nf4 import NF4Linear

def build(sharded):
    torch.set_default_dtype(torch.bfloat16)
    try:
        with init_empty():
            model = GPT(config())
    finally:
        torch.set_default_dtype(torch.float32)
    if sharded:
        quantize_for_sharding(model, LoadOptions(quantize="torchao.nf4"), count=world, dtype=torch.bfloat16)
        model = shard_model(model, mesh)
    return model

import torch.distributed as dist

def all_reduces(load):
    # how many all-reduces load() makes
    calls, real = [], dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        load()
    finally:
        dist.all_reduce = real
    return len(calls)

reference = torch.load(args["reference"], weights_only=True)
share = sum(torch.chunk(t, world)[rank].nbytes for t in reference.values())
plain = build(sharded=False)
plain_reduces = all_reduces(lambda: load_checkpoint(shard_model(plain, mesh), args["path"], progress=False))
model = build(sharded=True)
report = None
def load_nf4():
    global report
    report = load_checkpoint(model, args["path"], quantize="torchao.nf4", progress=False)
nf4_reduces = all_reduces(load_nf4)
single = build(sharded=False)
load_checkpoint(single, args["path"], quantize="torchao.nf4", progress=False)
different = []
for name, module in single.named_modules():
    if type(module) is NF4Linear:
        want = torch.chunk(module.weight, world)[rank]
        got = model.get_submodule(name).weight.to_local()
        inner, _ = want.__tensor_flatten__()
        if not all(torch.equal(getattr(got, n), getattr(want, n)) for n in inner):
            different.append(name)
tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    same = torch.equal(model(tokens), single(tokens))
emit(bytes_read=report.bytes_read, share=share, quantized=len(report.quantized), different=different,
     logits_equal=same, all_reduces_over_bf16=nf4_reduces - plain_reduces)

# a read error on rank 1 before the second block's qkv weight: rank 0 stops before that weight's all-reduce
model = build(sharded=True)
read = Reader.read
def failing(self, rec, *a, **k):
    if rank == 1 and rec.key == "transformer.h.1.attn.qkv.weight":
        raise OSError(5, "Input/output error (injected)")
    return read(self, rec, *a, **k)
Reader.read = failing
try:
    load_checkpoint(model, args["path"], quantize="torchao.nf4", progress=False)
    emit(failed=None)
except Exception as e:
    emit(failed=type(e).__name__, message=str(e)[:300])
"""


@pytest.fixture(scope="module")
def nf4_checkpoint(tmp_path_factory, shard_config, tiny_gpt, write_checkpoint):
    from litgpt import Config

    state = tiny_gpt(Config(**shard_config), torch.bfloat16, std=0.3).state_dict()
    root = tmp_path_factory.mktemp("nf4-rows")
    torch.save(state, root / "reference.pt")
    return str(write_checkpoint(state, "safetensors", root / "safetensors")), str(root / "reference.pt")


def test_each_rank_reads_and_quantizes_only_its_rows(run_ranks, shard_config, nf4_checkpoint):
    """Bytes read per rank == its share of the file, every NF4 shard bit for bit ``torch.chunk(to_nf4(w))``'s, the
    logits those of a single-process NF4 load, one all-reduce per quantized weight more than a bf16 load makes;
    then an injected read error on rank 1 raises on both ranks."""
    path, reference = nf4_checkpoint
    ranks = run_ranks(NF4_BY_ROWS, dict(config=shard_config, path=path, reference=reference), timeout=300)
    for result in ranks:
        assert result.returncode == 0 and not result.timed_out, result.stderr[-3000:]
        got = result.values
        assert got["quantized"] == 8
        assert got["bytes_read"] == got["share"], result.rank  # its rows only, the quantized weights too
        assert got["different"] == [] and got["logits_equal"], result.rank
        assert got["all_reduces_over_bf16"] == got["quantized"]  # one per quantized weight: the sum is the check
    assert sum(r.values["share"] for r in ranks) == sum(
        t.nbytes for t in torch.load(reference, weights_only=True).values())
    # both ranks raise the failing rank's error, naming it (rank 0 met it in the check before its all-reduce)
    assert ranks[0].values["failed"] == ranks[1].values["failed"] == "LowMemError"  # a bare OSError, wrapped
    assert ranks[0].values["message"] == ranks[1].values["message"]
    assert "Rank 1" in ranks[0].values["message"] and "Input/output error" in ranks[0].values["message"]
