"""The load plan, made from headers before any read: shapes, missing and unexpected keys, tied weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem import CheckpointMismatchError, MetaTensorError, init_empty, load_checkpoint


def test_shape_mismatch_names_file_key_and_both_shapes_before_reading(tmp_path, litgpt_model, write_checkpoint,
                                                                      tiny_config, meta_gpt):
    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    model = meta_gpt(tiny_config(n_embd=64))
    with pytest.raises(CheckpointMismatchError) as err:
        load_checkpoint(model, path)
    message = str(err.value)
    assert "model.safetensors" in message and "'lm_head.weight'" in message
    assert "[128, 32]" in message and "[128, 64]" in message
    assert all(p.is_meta for p in model.parameters())  # nothing was read or assigned


def _readable(message: str, path) -> None:
    """What a traceback's last lines show: the summary and what to do on the first line, then one line per tensor
    (at most ten of each kind), each short."""
    first, *details = message.splitlines()
    assert len(first.replace(str(path), "")) <= 250 and ("config" in first or "key_map" in first), first
    assert 1 <= len(details) <= 24 and all(len(line) <= 120 for line in details), details


def test_a_checkpoint_of_another_configuration_is_a_readable_message(tmp_path, tiny_config, tiny_gpt,
                                                                     write_checkpoint, meta_gpt):
    """Every tensor of another width: the summary and the fix first, then ten of them, one a line."""
    path = write_checkpoint(tiny_gpt(tiny_config(n_embd=64)).state_dict(), "safetensors", tmp_path)
    with pytest.raises(CheckpointMismatchError) as err:
        load_checkpoint(meta_gpt(tiny_config()), path)
    message = str(err.value)
    _readable(message, path)
    assert "  'lm_head.weight': checkpoint [128, 64], module [128, 32]" in message.splitlines()
    assert message.splitlines()[-1].startswith("  ... and ")


def test_missing_and_unexpected_keys_are_a_readable_message(tmp_path, write_checkpoint):
    """Every key of the checkpoint under another name: both kinds counted on the first line, ten of each listed."""
    with init_empty():
        model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(12)))
    state = {f"{i}.kernel": torch.zeros(4, 4) for i in range(12)}
    path = write_checkpoint(state, "safetensors", tmp_path)
    with pytest.raises(CheckpointMismatchError) as err:
        load_checkpoint(model, path)
    message = str(err.value)
    _readable(message, path)
    assert "(24 module tensors missing, 12 checkpoint keys with no place in the module)" in message.splitlines()[0]
    assert "  '0.weight'" in message.splitlines() and "  '0.kernel'" in message.splitlines()


def test_missing_and_unexpected_keys_strict_and_not(tmp_path, litgpt_model, write_checkpoint, meta_gpt):
    state = litgpt_model.state_dict()
    state.pop("transformer.ln_f.weight")
    state["extra.weight"] = torch.zeros(3)
    path = write_checkpoint(state, "safetensors", tmp_path)

    model = meta_gpt(litgpt_model.config)
    with pytest.raises(CheckpointMismatchError, match=r"(?s)transformer\.ln_f\.weight.*extra\.weight"):
        load_checkpoint(model, path)
    assert all(p.is_meta for p in model.parameters())

    with pytest.raises(MetaTensorError, match=r"transformer\.ln_f\.weight"):
        load_checkpoint(model, path, strict=False)  # the missing one would stay on meta

    real = meta_gpt(litgpt_model.config)
    real.transformer.ln_f.weight = nn.Parameter(torch.full((32,), 2.0))  # a real tensor stays as it is
    report = load_checkpoint(real, path, strict=False)
    assert report.missing == ["transformer.ln_f.weight"] and report.skipped == ["extra.weight"]
    assert torch.equal(real.transformer.ln_f.weight, torch.full((32,), 2.0))


def test_tied_weights_saved_twice_are_read_once(tmp_path, write_checkpoint):
    """torch.save writes both names of a tied weight; the loader reads one and keeps the tie."""
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    source = nn.ModuleDict({"wte": emb, "lm_head": head})
    path = write_checkpoint(source.state_dict(), "pth", tmp_path)
    with init_empty():
        target = nn.ModuleDict({"wte": nn.Embedding(10, 4), "lm_head": nn.Linear(4, 10, bias=False)})
        target.lm_head.weight = target.wte.weight
    report = load_checkpoint(target, path)
    assert report.tensors == 1
    assert target.lm_head.weight is target.wte.weight
    assert torch.equal(target.wte.weight, emb.weight)


@pytest.mark.parametrize("kind", ["safetensors", "pth"])
@pytest.mark.parametrize("strict", [True, False])
def test_a_key_held_bare_and_under_the_guessed_prefix_is_two_readings(tmp_path, write_checkpoint, kind, strict):
    """``a.weight`` (X) beside ``model.a.weight`` and ``model.b.*`` (Y): which copy of ``a.weight`` would load
    depended on the file's key order (safetensors sorts, a .pth keeps insertion order); it raises instead,
    naming both keys, before anything is read."""
    with init_empty():
        module = nn.Sequential()
        module.add_module("a", nn.Linear(4, 4, bias=False))
        module.add_module("b", nn.Linear(4, 4, bias=False))
    state = {"model.a.weight": torch.ones(4, 4), "a.weight": torch.zeros(4, 4), "model.b.weight": torch.ones(4, 4)}
    path = write_checkpoint(state, kind, tmp_path)
    with pytest.raises(CheckpointMismatchError, match=r"'(model\.)?a\.weight' and '(model\.)?a\.weight' both go to "
                                                       r"'a\.weight'.*Nothing was read"):
        load_checkpoint(module, path, strict=strict, progress=False)
    assert all(p.is_meta for p in module.parameters())


def test_tied_names_saved_twice_still_load_once(tmp_path, write_checkpoint):
    """Two keys for the two names of one tied tensor are no collision."""
    with init_empty():
        module = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    module[1].weight = module[0].weight
    weight = torch.randn(8, 4)
    path = write_checkpoint({"0.weight": weight, "1.weight": weight.clone()}, "safetensors", tmp_path)
    report = load_checkpoint(module, path, progress=False)
    assert report.tensors == 1 and torch.equal(module[1].weight, weight) and module[1].weight is module[0].weight
