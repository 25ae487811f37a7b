"""A sharded load that cannot go ahead stops every rank, before any rank reads, with the same typed error."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem.engine.ranks import agreement, rank

MISMATCH = """
from litgpt import GPT
from lightning_lowmem import Checkpoint, init_empty, load_checkpoint
from lightning_lowmem.placement import shard_model

reads = []
for method in ("read", "read_rows"):
    real = getattr(Checkpoint, method)
    setattr(Checkpoint, method, lambda self, key, *a, _real=real, **k: reads.append(key) or _real(self, key, *a, **k))

def attempt(path):
    with init_empty():
        model = shard_model(GPT(config()), mesh)
    try:
        load_checkpoint(model, path, progress=False)
    except Exception as e:
        return dict(error=type(e).__name__, message=str(e), on_meta=all(p.is_meta for p in model.parameters()))
    return dict(error=None)

emit(both=attempt(args["wrong"]), reads_both=len(reads))
emit(one=attempt(args["wrong"] if rank == 1 else args["right"]), reads_one=len(reads))
dist.barrier()  # the ranks are still in step: nobody hangs in a collective the other never joins
emit(done=True)
"""


@pytest.mark.slow
def test_a_checkpoint_mismatch_raises_the_same_error_on_every_rank_without_hanging(
        run_ranks, shard_config, tiny_gpt, write_checkpoint, tmp_path):
    from litgpt import Config

    right = write_checkpoint(tiny_gpt(Config(**shard_config)).state_dict(), "safetensors", tmp_path / "right")
    wider = Config(**{**shard_config, "intermediate_size": 1024})
    wrong = write_checkpoint(tiny_gpt(wider).state_dict(), "safetensors", tmp_path / "wrong")
    ranks = run_ranks(MISMATCH, dict(config=shard_config, right=str(right), wrong=str(wrong)), timeout=300)
    for result in ranks:
        assert not result.timed_out and result.returncode == 0, result.stderr[-3000:]
        assert result.values["done"]
        both, one = result.values["both"], result.values["one"]
        assert both["error"] == "CheckpointMismatchError" and "mlp.fc.weight" in both["message"]
        assert one["error"] == "CheckpointMismatchError"  # rank 0's own plan held, rank 1's did not
        assert both["on_meta"] and one["on_meta"]
        assert result.values["reads_both"] == result.values["reads_one"] == 0  # nothing read, anywhere
    assert "Rank 1 of 2 failed before reading" in ranks[0].values["one"]["message"]
    assert "mlp.fc.weight" in ranks[0].values["one"]["message"]


def test_without_a_process_group_the_block_runs_as_it_is():
    assert rank() == 0
    with pytest.raises(ValueError, match="own"), agreement(True):
        raise ValueError("own")
    with agreement(True):
        value = torch.ones(1)
    assert value.item() == 1


FAILURES = """
import errno, os
from litgpt import GPT
from lightning_lowmem import Checkpoint, LowMemError, init_empty, load_checkpoint
from lightning_lowmem.placement import shard_model

failing = {"key": None, "now": False}  # this rank's reads of failing["key"] fail in the system call itself
for method in ("read", "read_rows"):
    def wrapped(self, key, *a, _real=getattr(Checkpoint, method), **k):
        failing["now"] = key == failing["key"]
        try:
            return _real(self, key, *a, **k)
        finally:
            failing["now"] = False
    setattr(Checkpoint, method, wrapped)
real_preadv = os.preadv
def preadv(fd, buffers, offset):
    if failing["now"]:
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    return real_preadv(fd, buffers, offset)
os.preadv = preadv

def attempt(path):
    torch.set_default_dtype(torch.bfloat16)
    with init_empty():
        model = shard_model(GPT(config()), mesh)
    torch.set_default_dtype(torch.float32)
    try:
        load_checkpoint(model, path, progress=False)
    except Exception as e:
        return dict(error=type(e).__name__, message=str(e), ours=isinstance(e, LowMemError),
                    on_meta=all(p.is_meta for p in model.parameters()))
    return dict(error=None)

if rank == args["failing"]:
    failing["key"] = args["key"]
for name, path in args["paths"].items():
    emit(**{name: attempt(path)})
    dist.barrier()  # still in step: no rank is left in a collective another never joins
emit(done=True)
"""


def _check_every_rank_raised(ranks, name: str, error: str, failing: int) -> None:
    for result in ranks:
        assert not result.timed_out and result.returncode == 0, result.stderr[-3000:]
        assert result.values["done"]
        got = result.values[name]
        assert got["error"] == error and got["ours"] and got["on_meta"], got
        assert got["message"] == ranks[0].values[name]["message"]  # the same error, word for word, on every rank
        assert f"Rank {failing} of {len(ranks)} failed while reading its shard" in got["message"]


def test_a_read_error_on_one_rank_mid_stream_raises_the_same_error_on_every_rank(
        run_ranks, shard_config, tiny_gpt, write_checkpoint, tmp_path):
    from litgpt import Config

    path = write_checkpoint(tiny_gpt(Config(**shard_config), torch.bfloat16).state_dict(), "safetensors", tmp_path)
    ranks = run_ranks(FAILURES, dict(config=shard_config, paths={"eio": str(path)}, failing=1,
                                     key="transformer.h.1.attn.qkv.weight"), timeout=200)
    _check_every_rank_raised(ranks, "eio", "CheckpointReadError", failing=1)
    assert "Input/output error" in ranks[0].values["eio"]["message"]
    assert "transformer.h.1.attn.qkv.weight" in ranks[0].values["eio"]["message"]
