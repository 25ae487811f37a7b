"""The default FSDP2 layout: each block its own group, unless it ties a parameter outside itself."""

from __future__ import annotations

from torch import nn

from lightning_lowmem import init_empty
from lightning_lowmem.placement import shardable_blocks


def test_every_litgpt_block_is_sharded_on_its_own(meta_gpt, litgpt_config):
    model = meta_gpt(litgpt_config)
    model.lm_head.weight = model.transformer.wte.weight  # tied outside the blocks: both go with the root
    assert shardable_blocks(model) == list(model.transformer.h)


def test_a_block_tied_outside_itself_goes_with_the_root():
    with init_empty():
        model = nn.Sequential(nn.Embedding(10, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 10)]))
    model[1][1].weight = model[1][0].weight  # a tie between two blocks: neither is sharded alone
    model[1][2].weight = model[0].weight
    assert shardable_blocks(model) == []
    assert shardable_blocks(nn.Linear(2, 2)) == []  # no blocks: the root holds everything
