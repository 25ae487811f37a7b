"""Real Lightning checkpoints whose hyper-parameters are arbitrary Python objects: their weights load through every
face without building those objects; Lightning's own weights_only=False is honoured where Lightning honours it."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_lowmem import LowMemCallback, UnsafeCheckpointError, init_empty, load_checkpoint


def _touch(path: str) -> str:
    """What unpickling a ``Marker`` calls: a file that proves code from the checkpoint ran."""
    Path(path).write_text("ran")
    return path


class Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (_touch, (self.path,))


@dataclasses.dataclass
class Options:
    lr: float = 0.1
    name: str = "run"


class HParamsModule(L.LightningModule):
    def __init__(self, path: Path = Path("data"), options: Options = Options(),
                 namespace: argparse.Namespace = argparse.Namespace(a=1), marker: Marker | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.layer is None:
            self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).pow(2).sum()

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, **kwargs)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint from Trainer.fit of a module with a Path, a dataclass, a Namespace and a Marker as hyper-parameters."""
    directory = tmp_path_factory.mktemp("fit")
    marker = directory / "marker"
    torch.manual_seed(0)
    trainer = _trainer(max_steps=3, default_root_dir=directory)
    trainer.fit(HParamsModule(marker=Marker(str(marker))), DataLoader(torch.randn(12, 4), batch_size=4))
    trainer.save_checkpoint(directory / "fit.ckpt")
    marker.unlink(missing_ok=True)  # Lightning deep-copies hyper-parameters while training: that ran it
    return directory / "fit.ckpt", marker


def _reference(path: Path) -> HParamsModule:
    return HParamsModule.load_from_checkpoint(path, weights_only=False)


def _meta_module() -> HParamsModule:
    module = HParamsModule()
    with init_empty():
        module.configure_model()
    return module


def test_load_checkpoint_reads_the_weights_and_builds_nothing(trained):
    path, marker = trained
    module = _meta_module()
    load_checkpoint(module, path, progress=False)
    assert not marker.exists()
    reference = _reference(path)
    assert marker.exists()  # Lightning's own load does run it: the marker works
    marker.unlink()
    assert torch.equal(module.layer.weight, reference.layer.weight) and torch.equal(module.layer.bias,
                                                                                    reference.layer.bias)


def test_the_callback_predicts_with_the_trained_weights(trained):
    path, marker = trained
    batches = DataLoader(torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), batch_size=3)
    ours = _trainer(callbacks=[LowMemCallback(path)]).predict(HParamsModule(), batches)
    assert not marker.exists()
    with_ckpt_path = _trainer(callbacks=[LowMemCallback(path)]).predict(HParamsModule(), batches, ckpt_path=path,
                                                                        weights_only=False)
    marker.unlink(missing_ok=True)  # weights_only=False: Lightning unpickles the hyper-parameters, as asked
    reference = _reference(path)
    marker.unlink(missing_ok=True)
    expected = [reference.layer(batch) for batch in batches]
    for got in (ours, with_ckpt_path):
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fabric_load_restores_what_it_can_and_says_what_it_left_out(trained):
    path, marker = trained
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="lowmem")
    module = HParamsModule()
    with fabric.init_module():
        module.configure_model()
    with pytest.warns(UserWarning, match=r"not restored: 'hyper_parameters'.*nothing was run.*weights_only=False"):
        rest = fabric.load(path, {"state_dict": module})
    assert not marker.exists()
    assert "hyper_parameters" not in rest and rest["global_step"] == 3 and "optimizer_states" in rest
    with pytest.raises(UnsafeCheckpointError, match=r"'hyper_parameters' you asked to restore.*nothing was run"):
        fabric.load(path, {"state_dict": module, "hyper_parameters": None})
    assert not marker.exists()
    state = {"state_dict": module, "hyper_parameters": None}
    fabric.load(path, state, weights_only=False)  # "I trust this file": built as torch.load builds it
    assert isinstance(state["hyper_parameters"]["options"], Options) and marker.exists()
    marker.unlink()
    reference = _reference(path)
    marker.unlink(missing_ok=True)
    assert torch.equal(module.layer.weight, reference.layer.weight)
