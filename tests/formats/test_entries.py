"""A torch file's entries beside the weights, rebuilt as torch.load builds them: each object once (sharing and
cycles kept), each storage read once with its tensors as views of it, and no more items than the bound."""

from __future__ import annotations

import sys

import pytest
import torch

from lightning_lowmem import Checkpoint, CheckpointFormatError
from lightning_lowmem.formats.entries import EntriesTooLargeError, inert_paths, rebuild
from lightning_lowmem.formats.unpickler import Inert


def test_entries_read_back_as_torch_load_gives_them(tmp_path):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    base = torch.arange(12.0)
    shared = [base[:6], base[6:].view(2, 3)]
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "views": shared,
                "pair": (shared, shared), "step": 3}, tmp_path / "fabric.ckpt")
    expected = torch.load(tmp_path / "fabric.ckpt", weights_only=True)
    with Checkpoint.open(tmp_path / "fabric.ckpt") as ckpt:
        rest, inert = ckpt.other_entries()
    assert not inert and set(rest) == {"optimizer", "views", "pair", "step"}
    for key, value in expected["optimizer"]["state"][0].items():
        assert torch.equal(rest["optimizer"]["state"][0][key], value)
    assert rest["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    first, second = rest["views"]
    assert torch.equal(first, base[:6]) and torch.equal(second, base[6:].view(2, 3))
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()  # one storage, read once
    assert rest["pair"][0] is rest["pair"][1] is rest["views"]  # one object, as the pickle made it


def test_a_list_that_holds_itself_is_rebuilt_holding_itself():
    cycle: list = [1]
    cycle.append(cycle)
    out = rebuild({"c": cycle}, lambda ref, where: None, limit=100)
    assert out["c"][1] is out["c"] and out["c"] is not cycle


def test_more_items_than_the_bound_are_refused():
    with pytest.raises(EntriesTooLargeError):
        rebuild({"a": list(range(100))}, lambda ref, where: None, limit=50)


def test_placeholders_are_found_once_however_many_paths_reach_them():
    x: list = [Inert("mod.Thing")]
    for _ in range(40):
        x = [x, x]
    assert inert_paths({"hp": x}) == ["hp" + "[0]" * 41]


def test_entries_nested_past_the_recursion_limit_are_a_typed_error(tmp_path):
    deep: list = [1]
    for _ in range(3000):
        deep = [deep]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # torch.save's pickler recurses too
    try:
        torch.save({"model": {"w": torch.ones(1)}, "deep": deep}, tmp_path / "deep.ckpt")
    finally:
        sys.setrecursionlimit(limit)
    with Checkpoint.open(tmp_path / "deep.ckpt") as ckpt, pytest.raises(CheckpointFormatError, match="nest too deeply"):
        ckpt.other_entries()
