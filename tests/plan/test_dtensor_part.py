"""This rank's part of a DTensor, as the plan sees it: which rows it reads, what it holds."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_lowmem.formats.records import TensorRecord
from lightning_lowmem.plan import Target
from lightning_lowmem.plan.dtensor_part import Shard, is_dtensor


def test_a_block_of_whole_rows_is_read_on_its_own():
    assert Shard((101, 256), (51, 0), (50, 256), index=1, count=2).rows == (51, 101)
    assert Shard((101, 256), (102, 0), (0, 256), index=2, count=3).rows == (102, 102)  # holds none of it
    assert Shard((8, 6), (0, 3), (8, 3)).rows is None  # a box of columns: cut out of the whole tensor
    assert Shard((8, 6), (0, 3), (8, 3)).region == (slice(0, 8), slice(3, 6))


def test_a_row_shard_reads_and_holds_its_share():
    record = TensorRecord("w", (101, 256), torch.bfloat16, Path("model.safetensors"))
    shard = Shard((101, 256), (51, 0), (50, 256), index=1, count=2)
    target = Target(["w"], record, True, torch.bfloat16, torch.device("cpu"), shard=shard)
    assert target.read_nbytes == 50 * 256 * 2 and target.final_nbytes == 50 * 256 * 2
    target.scheme = type("Half", (), {"stored_nbytes": lambda self, shape: shape[0] * shape[1] // 2})()
    assert target.read_nbytes == record.nbytes  # a quantized shard: the whole weight is read, its rows kept
    assert target.final_nbytes == 50 * 256 // 2


def test_plain_tensors_are_not_dtensors():
    assert not is_dtensor(torch.ones(2)) and not is_dtensor(torch.nn.Parameter(torch.ones(2)))
