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
