"""The state dict where the file keeps it: any entry of a torch file, chosen the same way by every face."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from lightning_lowmem import (
    AmbiguousCheckpointError,
    LoadOptions,
    NoStateDictError,
    init_empty,
    load_checkpoint,
    placement_plan,
)
from lightning_lowmem.cli import main


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return Generator().state_dict()


def meta_generator() -> nn.Module:
    with init_empty():
        return Generator()


def assert_holds(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[k], v) for k, v in weights.items())


@pytest.mark.parametrize("entry", ["model_state_dict", "module", "ema", "params", "generator_weights"])
def test_a_state_dict_under_any_one_entry_loads_without_help(tmp_path, entry):
    """gemma_pytorch's {"model_state_dict": ...}, DeepSpeed's "module", a JAX port's "params", any other name."""
    torch.save({entry: state(0), "step": 1000, "config": {"lr": 1e-3}}, tmp_path / "g.ckpt")
    model = meta_generator()
    report = load_checkpoint(model, tmp_path / "g.ckpt", progress=False)
    assert report.entry == entry
    assert_holds(model, state(0))


def test_the_one_entry_that_fits_the_module_is_read(tmp_path):
    """A GAN checkpoint: the generator's state dict beside the discriminator's, whose names fit no tensor."""
    torch.manual_seed(1)
    discriminator = nn.Sequential(nn.Conv1d(1, 4, 3), nn.Linear(4, 1)).state_dict()
    torch.save({"discriminator": discriminator, "generator": state(0)}, tmp_path / "gan.pt")
    model = meta_generator()
    assert load_checkpoint(model, tmp_path / "gan.pt", progress=False).entry == "generator"
    assert_holds(model, state(0))


def test_a_fabric_checkpoint_with_loose_tensors_reads_its_model(tmp_path):
    torch.save({"model": state(0), "step": torch.tensor(7), "seed": torch.tensor(3)}, tmp_path / "fabric.ckpt")
    model = meta_generator()
    assert load_checkpoint(model, tmp_path / "fabric.ckpt", progress=False).entry == "model"


@pytest.fixture
def ema_file(tmp_path):
    path = tmp_path / "ema.ckpt"
    torch.save({"model": state(0), "ema": state(1), "epoch": 3}, path)
    return path


def test_two_entries_that_fit_are_refused_naming_both_and_the_option(ema_file, read_recorder):
    model = meta_generator()
    with pytest.raises(AmbiguousCheckpointError, match=r"2 of its entries hold state dicts that fit the module: "
                                                       r"'model' \(4 tensors\), 'ema' \(4 tensors\).*entry='ema' "
                                                       r"\(command line: --entry ema\)"):
        load_checkpoint(model, ema_file, progress=False)
    assert read_recorder.calls == [] and all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("entry, seed", [("ema", 1), ("model", 0)])
def test_the_entry_option_picks_one(ema_file, entry, seed):
    model = meta_generator()
    assert load_checkpoint(model, ema_file, entry=entry, progress=False).entry == entry
    assert_holds(model, state(seed))
    plan = placement_plan(meta_generator(), ema_file, {"cpu": "1GiB"}, options=LoadOptions(entry=entry))
    assert plan.weights_per_device()["cpu"] == sum(t.nbytes for t in state(seed).values())


def test_an_entry_that_is_not_there_names_the_ones_that_are(ema_file):
    with pytest.raises(NoStateDictError, match=r"no entry 'swa' holding tensors \(entry='swa'\); its entries "
                                               r"holding tensors are 'model' \(4 tensors\), 'ema' \(4 tensors\)"):
        load_checkpoint(meta_generator(), ema_file, entry="swa", progress=False)


def test_the_top_level_is_an_entry_too(tmp_path):
    """A flat state dict beside which someone saved another one: ``entry=""`` reads the top level."""
    torch.save({**state(0), "ema": state(1)}, tmp_path / "both.pt")
    model = meta_generator()
    with pytest.raises(AmbiguousCheckpointError, match="the top level"):
        load_checkpoint(model, tmp_path / "both.pt", progress=False)
    assert load_checkpoint(model, tmp_path / "both.pt", entry="", progress=False).entry == ""
    assert_holds(model, state(0))


@pytest.fixture
def ema_litgpt_dir(tmp_path, tiny_config, tiny_gpt, write_litgpt_dir):
    """A litgpt directory whose lit_model.pth holds the model and its EMA copy (different weights)."""
    config = tiny_config()
    directory = write_litgpt_dir(tmp_path / "pythia-ema", config, torch.float32)
    model = torch.load(directory / "lit_model.pth")
    ema = tiny_gpt(config, torch.float32, seed=5, std=0.3).state_dict()
    torch.save({"model": model, "ema": ema}, directory / "lit_model.pth")
    return directory, config, ema


def test_every_face_reads_the_same_entry(ema_litgpt_dir, meta_gpt, capsys):
    import lightning as L

    from lightning_lowmem import LowMemStrategy, estimate_memory, generate

    directory, config, ema = ema_litgpt_dir
    path = directory / "lit_model.pth"
    faces = {
        "load_checkpoint": lambda **kw: load_checkpoint(meta_gpt(config), path, progress=False, **kw),
        "estimate_memory": lambda **kw: estimate_memory(directory, max_seq_length=16, **kw),
        "generate": lambda **kw: generate(directory, [1, 2, 3], max_new_tokens=3, top_k=1, dtype=torch.float32, **kw),
    }
    for name, face in faces.items():
        with pytest.raises(AmbiguousCheckpointError, match="--entry ema"):
            face()
    model = meta_gpt(config)
    load_checkpoint(model, path, entry="ema", progress=False)
    assert_holds(model, ema)
    assert estimate_memory(directory, max_seq_length=16, entry="ema").weights == estimate_memory(
        directory, max_seq_length=16, entry="model").weights
    tokens = generate(directory, [1, 2, 3], max_new_tokens=3, top_k=1, dtype=torch.float32, entry="ema").tokens[0]
    with torch.no_grad():
        reference = model.eval()
        reference.set_kv_cache(1, 6)
        ids = torch.tensor([1, 2, 3])
        for _ in range(3):
            logits = reference(ids[None], torch.arange(len(ids)))
            reference.set_kv_cache(1, 6)
            ids = torch.cat([ids, logits[0, -1].argmax()[None]])
    assert tokens.tolist() == ids.tolist()

    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=LowMemStrategy(entry="ema"))
    with fabric.init_module():
        built = meta_gpt(config)
    fabric.load_raw(path, built)
    assert_holds(built, ema)

    assert main(["inspect", str(directory), "--json"]) == 1
    assert "--entry ema" in capsys.readouterr().err
    assert main(["inspect", str(directory), "--entry", "ema", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["entry"] == "ema" and summary["config"]["matches"]
