"""Shared fixtures: tiny real models and their checkpoints, written with the tools users use."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", message=".*register_constant.*")


def tiny_litgpt_config(**overrides):
    from litgpt import Config

    kwargs = dict(name="tiny", block_size=64, vocab_size=96, padded_vocab_size=96, n_layer=2, n_head=4,
                  n_embd=32, rotary_percentage=0.25, parallel_residual=True, bias=True)
    kwargs.update(overrides)
    return Config(**kwargs)


@pytest.fixture
def litgpt_config():
    return tiny_litgpt_config()


@pytest.fixture
def litgpt_model(litgpt_config):
    from litgpt import GPT

    torch.manual_seed(0)
    return GPT(litgpt_config).eval()


def write_checkpoint(state: dict[str, torch.Tensor], kind: str, directory: Path) -> Path:
    """Write ``state`` the way users do; returns what to pass to ``load_checkpoint``."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in state.items()}
    if kind == "safetensors":
        path = directory / "model.safetensors"
        save_file(state, path)
    elif kind == "pth":
        path = directory / "lit_model.pth"
        torch.save(state, path)
    elif kind == "lightning":
        path = directory / "epoch=0-step=1.ckpt"
        torch.save({"state_dict": state, "epoch": 0, "global_step": 1, "optimizer_states": []}, path)
    elif kind == "fabric":
        path = directory / "fabric.ckpt"
        torch.save({"model": state, "step": 3}, path)
    elif kind in ("sharded-safetensors", "sharded-bin"):
        path = _write_shards(state, directory, kind.endswith("bin"))
    else:
        raise ValueError(kind)
    return path


def _write_shards(state: dict[str, torch.Tensor], directory: Path, pickle: bool, n: int = 4) -> Path:
    """A sharded set laid out as save_pretrained writes it: N shards and an index.json."""
    from safetensors.torch import save_file

    keys = list(state)
    ext, stem = ("bin", "pytorch_model") if pickle else ("safetensors", "model")
    weight_map = {}
    for i in range(n):
        name = f"{stem}-{i + 1:05d}-of-{n:05d}.{ext}"
        part = {k: state[k] for k in keys[i::n]}
        torch.save(part, directory / name) if pickle else save_file(part, directory / name)
        weight_map.update({k: name for k in part})
    index = directory / f"{stem}.{ext}.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


FORMATS = ["safetensors", "sharded-safetensors", "pth", "sharded-bin", "lightning", "fabric"]
