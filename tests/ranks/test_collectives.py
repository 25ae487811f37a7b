"""The library's collectives run on the device the process group reduces (the CPU under gloo, CUDA under NCCL), and a
rank killed inside one is a ``RankLostError`` on the ranks left, not the backend's raw ``RuntimeError``."""

from __future__ import annotations

import ast

import pytest
import torch

from lightning_lowmem.ranks.collectives import device_type_for


@pytest.mark.parametrize(("backend", "device"), [
    ("gloo", "cpu"),  # gloo takes CPU (and CUDA) tensors: the library's few bytes stay on the CPU
    ("nccl", "cuda"),  # Lightning's CUDA strategies: an NCCL-only group, which has no CPU backend
    ("cuda:nccl", "cuda"),
    ("cpu:gloo,cuda:nccl", "cpu"),  # init_process_group() on a CUDA build: the CPU's backend is there
    ("cuda:nccl,cpu:gloo", "cpu"),
    ("NCCL", "cuda"),
    ("xccl", "xpu"),
    ("mpi", "cpu"),
])
def test_the_collective_device_follows_the_backend_the_group_reports(backend, device):
    assert device_type_for(backend) == device


def test_a_backend_torch_does_not_know_is_a_clear_error():
    with pytest.raises(ValueError, match=r"'mybackend' .*not one torch knows.*register_backend"):
        device_type_for("mybackend")


_COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
                "reduce", "reduce_scatter", "gather_object", "scatter_object_list", "all_to_all", "send", "recv",
                "all_gather_into_tensor", "reduce_scatter_tensor", "monitored_barrier"}


def test_every_collective_of_the_library_runs_inside_collective():
    """Each ``dist.<collective>(...)`` call of the package sits in a ``with collective(...)`` block: a lost rank is our
    error wherever the library waits for the others."""
    from pathlib import Path

    import lightning_lowmem

    found, bare = [], []
    for path in Path(lightning_lowmem.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        guarded = {id(node) for w in ast.walk(tree) if isinstance(w, ast.With)
                   and any(isinstance(i.context_expr, ast.Call) and getattr(i.context_expr.func, "id", "") ==
                           "collective" for i in w.items) for node in ast.walk(w)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _COLLECTIVES
                    and getattr(node.func.value, "id", "") == "dist"):
                found.append(f"{path.name}:{node.lineno}")
                if id(node) not in guarded:
                    bare.append(f"{path.name}:{node.lineno} dist.{node.func.attr}")
    assert len(found) >= 4 and not bare, bare


GLOO = """
from lightning_lowmem.ranks.collectives import collective_device
from lightning_lowmem.ranks.agreement import agreement, check_peers, from_first_rank

emit(device=str(collective_device()), mesh_device=str(collective_device(mesh.get_group(0))))
with agreement(True, share=True) as agreed:
    check_peers()
    agreed.share = from_first_rank(lambda: {"made on": rank})
emit(shared=agreed.shared)
"""


def test_on_gloo_the_collectives_run_on_the_cpu(run_ranks):
    ranks = run_ranks(GLOO, {}, timeout=120)
    for result in ranks:
        assert not result.timed_out and result.returncode == 0, result.stderr[-3000:]
        assert result.values["device"] == result.values["mesh_device"] == "cpu"
        assert result.values["shared"] == [{"made on": 0}, {"made on": 0}]



SUMS = """
import torch.distributed as dist
from lightning_lowmem.ranks.agreement import agreement, checked_sum

alone = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
calls = []
real = dist.all_reduce
dist.all_reduce = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
value = torch.tensor(rank + 0.5, dtype=torch.bfloat16)
with agreement(True):
    both = checked_sum(value, mesh.get_group(0), "a sum of both")
    own = checked_sum(value, alone[rank], "a sum of one")
emit(both=both.item(), both_dtype=str(both.dtype), own=own.item(), calls=len(calls))
try:  # rank 1 fails before the sum: rank 0 meets its failure check in the sum's all-reduce
    with agreement(True, stage="while reading its shard"):
        if rank == 1:
            raise OSError(5, "Input/output error (injected)")
        checked_sum(value, mesh.get_group(0), "a sum of both")
        emit(went_on=True)
except Exception as e:
    emit(error=type(e).__name__, message=str(e))
"""


def test_a_sum_inside_a_stage_is_one_all_reduce_that_also_checks_the_peers(run_ranks):
    """``checked_sum`` of each rank's group (both ranks, then each alone): the group's float64 sum, back on the
    value's device, one all-reduce each (the stage's end adds one); a rank that failed before the sum, gone to its
    stage's end, meets the other in that all-reduce and both raise its error."""
    ranks = run_ranks(SUMS, {}, timeout=120)
    for result in ranks:
        assert not result.timed_out and result.returncode == 0, result.stderr[-3000:]
        got = result.values
        assert got["both"] == 2.0 and got["own"] == result.rank + 0.5 and got["both_dtype"] == "torch.float64"
        assert got["calls"] == 3  # two sums + the stage's own failure check, no check_peers beside each sum
        assert "went_on" not in got and got["error"] == "LowMemError", got  # a bare OSError, wrapped
        assert "Rank 1 of 2 failed while reading its shard" in got["message"], got["message"]
        assert "Input/output error" in got["message"]

KILLED = """
import signal, time
from litgpt import GPT
from lightning_lowmem import Checkpoint, LowMemError, RankLostError, init_empty, load_checkpoint
from lightning_lowmem.placement import shard_model

if rank == 1:  # killed for real at its last read, once rank 0 waits in the stream's agreement
    real = Checkpoint.read_rows
    def read_rows(self, key, *a, **k):
        if key == args["key"]:
            time.sleep(3)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, key, *a, **k)
    Checkpoint.read_rows = read_rows

with init_empty():
    model = shard_model(GPT(config()), mesh)
started = time.monotonic()
try:
    load_checkpoint(model, args["path"], progress=False)
    emit(error=None)
except Exception as e:
    emit(error=type(e).__name__, message=str(e), ours=isinstance(e, LowMemError), runtime=isinstance(e, RuntimeError),
         on_meta=all(p.is_meta for p in model.parameters()), seconds=time.monotonic() - started,
         cause=type(e.__cause__).__name__)
os._exit(0)  # the group lost a rank: no barrier at exit
"""


@pytest.mark.slow
def test_a_rank_killed_inside_a_collective_is_a_rank_lost_error_on_the_others(
        run_ranks, shard_config, tiny_gpt, write_checkpoint, tmp_path):
    from litgpt import Config

    path = write_checkpoint(tiny_gpt(Config(**shard_config), torch.bfloat16).state_dict(), "safetensors", tmp_path)
    survivor, killed = run_ranks(KILLED, dict(config=shard_config, path=str(path), key="lm_head.weight"), timeout=200)
    assert killed.returncode == -9  # SIGKILL, for real
    assert not survivor.timed_out and survivor.returncode == 0, survivor.stderr[-3000:]
    got = survivor.values
    assert got["error"] == "RankLostError" and got["ours"] and got["runtime"] and got["on_meta"], got
    assert got["cause"] == "RuntimeError"  # gloo's own error, chained
    assert "rank 0 of 2" in got["message"] and "while reading its shard" in got["message"]
    assert "start every rank again" in got["message"]


NCCL = """
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
from lightning_lowmem.ranks.collectives import collective_device
from lightning_lowmem.ranks.agreement import agreement, check_peers, checked_sum

emit(backend=str(dist.get_backend()), device=str(collective_device()))
with agreement(True, share=True) as agreed:
    check_peers()
    agreed.share = rank
    total = checked_sum(torch.tensor(rank + 0.5, device=f"cuda:{rank}"), dist.group.WORLD, "a sum")
emit(shared=agreed.shared, total=total.item(), total_device=str(total.device))
try:
    with agreement(True):
        if rank == 0:
            raise ValueError("rank 0's own")
except ValueError as e:
    emit(error=str(e))
dist.destroy_process_group()
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_nccl_the_agreement_runs_on_this_rank_s_gpu(run_ranks):
    world = min(torch.cuda.device_count(), 2)
    ranks = run_ranks(NCCL, {}, world=world, init=False, timeout=200)
    for result in ranks:
        assert not result.timed_out and result.returncode == 0, result.stderr[-3000:]
        assert result.values["backend"] == "nccl" and result.values["device"] == f"cuda:{result.rank}"
        assert result.values["shared"] == list(range(world))
        assert result.values["total"] == world * world / 2 and result.values["total_device"] == f"cuda:{result.rank}"
        assert "Rank 0 of" in result.values["error"] and "rank 0's own" in result.values["error"]


NO_SET_DEVICE = """
dist.init_process_group("nccl")  # no set_device, no device_id: a torchrun script as often written; LOCAL_RANK is set
from lightning_lowmem.ranks.collectives import collective_device
from lightning_lowmem.ranks.agreement import agreement, check_peers, from_first_rank

emit(current=torch.cuda.current_device(), device=str(collective_device()))
with agreement(True, share=True) as agreed:
    check_peers()
    agreed.share = from_first_rank(lambda: {"made on": rank})
emit(shared=agreed.shared)
dist.destroy_process_group()
"""


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_on_nccl_without_set_device_each_rank_uses_its_own_gpu(run_ranks):
    """Two ranks that never call ``torch.cuda.set_device``: their current device is cuda:0 on both, and the library's
    collectives go to cuda:LOCAL_RANK (taking the current device put both ranks' NCCL tensors on one GPU)."""
    ranks = run_ranks(NO_SET_DEVICE, {}, world=2, init=False, timeout=300)
    for result in ranks:
        assert not result.timed_out and result.returncode == 0, result.stderr[-3000:]
        assert result.values["current"] == 0 and result.values["device"] == f"cuda:{result.rank}"
        assert result.values["shared"] == [{"made on": 0}, {"made on": 0}]
