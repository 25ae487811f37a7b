"""This rank's device comes from its process group (the device it is bound to), else ``LOCAL_RANK``, else the only
device there is; never from the current device, which a torchrun script that never calls ``set_device`` leaves at
device 0 on every rank."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem.runtime.execution import device_index


@pytest.mark.parametrize(("bound", "local_rank", "count", "index"), [
    (torch.device("cuda", 1), "0", 8, 1),  # Lightning binds the group to the rank's device: that one
    (None, "3", 8, 3),  # torchrun: LOCAL_RANK
    (None, "3", 1, 0),  # one device visible to this rank (CUDA_VISIBLE_DEVICES set per rank)
    (None, None, 1, 0),
    (torch.device("xpu", 2), "5", 8, 5),  # a binding to another kind of device says nothing of this one
])
def test_the_ranks_device_is_the_bound_one_else_local_rank_else_the_only_one(bound, local_rank, count, index):
    assert device_index("cuda", bound, local_rank, count) == index


@pytest.mark.parametrize(("local_rank", "count", "seen"), [(None, 4, "no LOCAL_RANK"), ("6", 4, "LOCAL_RANK=6")])
def test_a_rank_whose_device_nothing_tells_is_refused_saying_how_to_tell_it(local_rank, count, seen):
    with pytest.raises(ValueError, match=rf"not known.*{seen}.*sees 4 cuda devices.*device_id=.*torchrun"):
        device_index("cuda", None, local_rank, count)


BOUND = """
from lightning_lowmem.ranks.collectives import collective_device
from lightning_lowmem.runtime.rank_device import mesh_device, rank_device

group = dist.distributed_c10d._get_default_group()
group.bound_device_id = torch.device("cuda", rank)  # as init_process_group(device_id=...) binds it
emit(bound=str(rank_device("cuda", group)), subgroup=str(rank_device("cuda", mesh.get_group())),
     collective=str(collective_device()), mesh=str(mesh_device(mesh)))
"""


def test_on_two_ranks_each_takes_the_device_its_group_is_bound_to(run_ranks):
    """Two gloo processes whose group is bound to cuda:<rank>: each rank's device is its own (the current device of
    both would be cuda:0), and gloo's collectives and a CPU mesh stay on the CPU."""
    for result in run_ranks(BOUND, {}, timeout=120):
        assert not result.timed_out and result.returncode == 0, result.stderr[-3000:]
        assert result.values["bound"] == result.values["subgroup"] == f"cuda:{result.rank}"
        assert result.values["collective"] == result.values["mesh"] == "cpu"
