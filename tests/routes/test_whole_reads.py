"""Which sharded tensors a rank reads whole, and why, decided from the plan before any read."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_lowmem.routes.route import Traits
from lightning_lowmem.routes.whole_reads import whole_reads
from lightning_lowmem.formats import TensorRecord
from lightning_lowmem.plan import LoadPlan, Target
from lightning_lowmem.plan.dtensor_part import Shard
from lightning_lowmem.quantize import make_scheme


def _target(name: str, shape: tuple[int, int], shard: Shard, scheme: object = None) -> Target:
    rec = TensorRecord(name, shape, torch.bfloat16, Path("model.safetensors"))
    return Target([name], rec, True, torch.bfloat16, torch.device("cpu"), scheme=scheme, shard=shard)


def test_only_parts_that_are_not_own_rows_are_listed_with_their_reason():
    nf4 = make_scheme("torchao.nf4")
    plan = LoadPlan([
        _target("rows", (8, 4), Shard((8, 4), (4, 0), (4, 4), index=1, count=2)),
        _target("columns", (8, 4), Shard((8, 4), (0, 2), (8, 2))),
        _target("replicated", (8, 4), Shard((8, 4), (0, 0), (8, 4))),
        _target("nf4", (256, 256), Shard((256, 256), (128, 0), (128, 256), index=1, count=2), nf4),
        _target("nf4-uneven", (256, 64), Shard((256, 64), (128, 0), (128, 64), index=1, count=2), nf4),
    ])
    reasons = whole_reads(plan, Traits())
    assert set(reasons) == {"columns", "nf4-uneven"}
    assert "columns 2:4 of its 4 (tensor parallel)" in reasons["columns"]
    assert "torchao.nf4" in reasons["nf4-uneven"] and "do not split evenly" in reasons["nf4-uneven"]
    assert set(whole_reads(plan, Traits(reads_rows=lambda key: key != "rows"))) == {"columns", "nf4-uneven", "rows"}
    transformed = whole_reads(plan, Traits(transform=lambda name, tensor: tensor))
    assert "rewrites the whole tensor" in transformed["nf4"]
