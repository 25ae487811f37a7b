"""Layers: a model's tensors grouped into the units that move whole; a block is never split, ties stay together."""

from __future__ import annotations

from torch import nn

from lightning_lowmem import init_empty, placement_plan


class TiedLM(nn.Module):
    """An input embedding tied to the output head, with blocks in between."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)) for _ in range(2))
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight


def test_blocks_are_never_split_and_other_modules_are_top_level(tiny_config, meta_gpt):
    model = meta_gpt(tiny_config(n_layer=3))
    plan = placement_plan(model, None, {"cpu": "1GiB"})
    names = [layer.name for layer in plan.layers]
    assert names == ["lm_head", "transformer.wte", "transformer.h.0", "transformer.h.1", "transformer.h.2",
                     "transformer.ln_f"]
    for layer in plan.layers:
        assert all(t.startswith(layer.name + ".") for t in layer.tensors)
    block_tensors = [n for n in model.state_dict() if n.startswith("transformer.h.1.")]
    assert sorted(plan.layers[3].tensors) == sorted(block_tensors)
    assert sum(layer.nbytes for layer in plan.layers) == sum(t.numel() * t.element_size()
                                                             for t in model.state_dict().values())


def test_tied_modules_form_one_layer():
    with init_empty():
        model = TiedLM()
    plan = placement_plan(model, None, {"cuda:0": 9000, "cpu": "1GiB"})
    tied = [layer for layer in plan.layers if "embed" in layer.name]
    assert len(tied) == 1 and sorted(tied[0].modules) == ["embed", "head"]
    assert plan.device_of("embed.weight") == plan.device_of("head.weight")
