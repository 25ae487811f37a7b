"""Checkpoint keys -> module names: explicit key maps (dict, callable, None to drop) and a guessed prefix."""

from __future__ import annotations

import torch
from torch import nn

from lightning_lowmem import load_checkpoint


def test_key_map_dict_callable_and_guessed_prefix(tmp_path, litgpt_model, write_checkpoint, meta_gpt):
    state = {f"model.{k}": v for k, v in litgpt_model.state_dict().items()}
    path = write_checkpoint(state, "safetensors", tmp_path)
    x = torch.randint(0, 100, (1, 8))
    for key_map in ({"model.": ""}, lambda k: k.removeprefix("model."), None):
        model = meta_gpt(litgpt_model.config)
        report = load_checkpoint(model, path, key_map=key_map)
        torch.testing.assert_close(model.eval()(x), litgpt_model(x), rtol=0, atol=0)
    assert "stripped 'model.'" in report.key_note

    # a key the callable sends to None is dropped on purpose: not unexpected, even under strict=True
    extra = write_checkpoint(state | {"model.optimizer_step": torch.zeros(())}, "safetensors", tmp_path / "extra")
    model = meta_gpt(litgpt_model.config)
    drop = lambda k: None if k == "model.optimizer_step" else k.removeprefix("model.")  # noqa: E731
    report = load_checkpoint(model, extra, key_map=drop)
    assert report.skipped == [] and report.tensors == len(state)

    # the other way: a bare model file into a wrapper module that holds it as .model
    bare = write_checkpoint(litgpt_model.state_dict(), "pth", tmp_path / "bare")
    wrapper = nn.Module()
    wrapper.model = meta_gpt(litgpt_model.config)
    report = load_checkpoint(wrapper, bare)
    assert "added 'model.'" in report.key_note
