"""LowMemCallback: the Trainer builds the model on meta in configure_model and streams the checkpoint in."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import tiny_litgpt_config, write_checkpoint
from test_strategy import _has_scheme, _lora_config, lora_key_map
from torch.utils.data import DataLoader

from lightning_lowmem import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    LowMemCallback,
    UnsupportedQuantizationError,
)

NF4 = pytest.param("bnb.nf4", marks=pytest.mark.skipif(not _has_scheme("bnb.nf4"),
                                                       reason="the bnb.nf4 scheme is not available"))


class LitGPT(L.LightningModule):
    """A LightningModule wrapping one litgpt GPT as ``self.model``, built in configure_model."""

    def __init__(self, config, lora: bool = False, build_in_init: bool = False) -> None:
        super().__init__()
        self.config, self.lora = config, lora
        self.model: torch.nn.Module | None = None
        self.losses: list[float] = []
        self.optimizer_configured = False
        if build_in_init:
            self.configure_model()

    def configure_model(self) -> None:
        if self.model is not None:  # idempotent, as Lightning asks
            return
        if self.lora:
            from litgpt.lora import GPT, mark_only_lora_as_trainable

            self.model = GPT(self.config)
            mark_only_lora_as_trainable(self.model)
        else:
            from litgpt import GPT

            self.model = GPT(self.config)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.optimizer_configured = True
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=5e-2)


def _trainer(callback: LowMemCallback, precision: str = "32-true", **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, precision=precision, callbacks=[callback], logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def _data(rows: int = 4, length: int = 17) -> DataLoader:
    return DataLoader(torch.randint(0, 96, (rows, length), generator=torch.Generator().manual_seed(0)), batch_size=4)


def _eager(reference: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    from litgpt import GPT

    model = GPT(reference.config).to(dtype)
    model.load_state_dict(reference.state_dict())
    return model.eval()


@pytest.mark.parametrize("kind", ["pth", "safetensors", "lightning-ckpt"])
@pytest.mark.parametrize("precision", ["bf16-true", "32-true"])
def test_predict_equals_eager(tmp_path, litgpt_model, kind, precision):
    """Keys of the wrapped model (lit_model.pth) and of the LightningModule (.ckpt) both load."""
    state = litgpt_model.state_dict()
    if kind == "lightning-ckpt":
        path = write_checkpoint({f"model.{k}": v for k, v in state.items()}, "lightning", tmp_path)
    else:
        path = write_checkpoint(state, kind, tmp_path)
    lit = LitGPT(litgpt_model.config)
    callback = LowMemCallback(path)
    out = _trainer(callback, precision).predict(lit, _data())

    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert {p.dtype for p in lit.model.parameters()} == {dtype}
    expected = _eager(litgpt_model, dtype)(next(iter(_data())))
    torch.testing.assert_close(out[0], expected, rtol=0, atol=0)
    assert callback.report.tensors == len(state)
    assert ("model." in callback.report.key_note) == (kind != "lightning-ckpt")


def test_validate_and_test(tmp_path, litgpt_model):
    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    lit = LitGPT(litgpt_model.config)
    trainer = _trainer(LowMemCallback(path))
    val = trainer.validate(lit, _data())[0]["val_loss"]
    test = trainer.test(lit, _data())[0]["test_loss"]

    batch = next(iter(_data()))
    logits = _eager(litgpt_model, torch.float32)(batch[:, :-1])
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 96), batch[:, 1:].reshape(-1)).item()
    assert val == pytest.approx(expected, rel=1e-6) and test == pytest.approx(expected, rel=1e-6)


def test_model_built_in_init_warns_and_still_loads(tmp_path, litgpt_model):
    path = write_checkpoint(litgpt_model.state_dict(), "pth", tmp_path)
    torch.manual_seed(123)
    lit = LitGPT(litgpt_model.config, build_in_init=True)
    with pytest.warns(UserWarning, match="already holds .* allocated parameters"):
        out = _trainer(LowMemCallback(path)).predict(lit, _data())
    torch.testing.assert_close(out[0], _eager(litgpt_model, torch.float32)(next(iter(_data()))), rtol=0, atol=0)


def test_bad_checkpoints_fail_before_training(tmp_path, litgpt_model):
    lit = LitGPT(litgpt_model.config)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        _trainer(LowMemCallback(tmp_path / "missing" / "lit_model.pth"), max_steps=2).fit(lit, _data())
    from litgpt import GPT

    other = write_checkpoint(GPT(tiny_litgpt_config(n_layer=3)).state_dict(), "pth", tmp_path / "three-layers")
    lit = LitGPT(litgpt_model.config)
    with pytest.raises(CheckpointMismatchError, match="transformer.h.2"):
        _trainer(LowMemCallback(other), max_steps=2).fit(lit, _data())
    assert lit.losses == [] and not lit.optimizer_configured
    assert all(p.is_meta for p in lit.model.parameters())  # nothing was read


def test_bad_options_fail_when_built():
    with pytest.raises(UnsupportedQuantizationError):
        LowMemCallback("x.pth", quantize="int3")


@pytest.mark.parametrize("quantize", [None, NF4])
def test_qlora_fit_predict_save_and_reload(tmp_path, quantize):
    """Frozen (quantized) base, trainable LoRA adapters: loss goes down, base unchanged, adapters reload."""
    from litgpt import GPT

    torch.manual_seed(0)
    # n_embd >= 64: bitsandbytes' CPU inference kernel needs in_features >= its 64-weight blocks.
    path = write_checkpoint(GPT(tiny_litgpt_config(n_embd=64)).state_dict(), "pth", tmp_path)
    options = dict(quantize=quantize, key_map=lambda k: "model." + lora_key_map(k))
    lit = LitGPT(_lora_config(n_embd=64), lora=True)
    callback = LowMemCallback(path, **options)
    trainer = _trainer(callback, "bf16-true", max_steps=8)
    snapshot = {}
    trainer.callbacks.append(L.pytorch.callbacks.LambdaCallback(on_train_start=lambda t, m: snapshot.update(
        {n: p.detach().clone() for n, p in m.named_parameters() if not p.requires_grad})))
    trainer.fit(lit, _data())

    assert lit.losses[-1] < lit.losses[0] * 0.9
    trainable = {n for n, p in lit.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert snapshot and all(torch.equal(p, snapshot[n]) for n, p in lit.named_parameters() if n in snapshot)
    if quantize:
        assert type(lit.model.transformer.h[0].attn.qkv.linear).__name__ == "Linear4bit"
        assert len(callback.report.quantized) >= 8
    predicted = trainer.predict(lit, _data())[0]  # same process, next stage: keeps the trained adapters

    trainer.save_checkpoint(tmp_path / "adapter.ckpt")
    saved = torch.load(tmp_path / "adapter.ckpt", weights_only=True)["state_dict"]
    assert set(saved) == trainable  # only what trains: the base comes from `path` again

    again = LitGPT(_lora_config(n_embd=64), lora=True)
    out = _trainer(LowMemCallback(path, **options), "bf16-true").predict(again, _data(),
                                                                          ckpt_path=tmp_path / "adapter.ckpt")
    torch.testing.assert_close(out[0], predicted, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_predict_equals_eager(tmp_path, litgpt_model):
    path = write_checkpoint(litgpt_model.state_dict(), "pth", tmp_path)
    lit = LitGPT(litgpt_model.config)
    trainer = L.Trainer(accelerator="cuda", devices=1, precision="bf16-true", callbacks=[LowMemCallback(path)],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    out = trainer.predict(lit, _data())
    expected = _eager(litgpt_model, torch.bfloat16).cuda()(next(iter(_data())).cuda())
    torch.testing.assert_close(out[0].cuda(), expected, rtol=0, atol=0)


def test_max_memory_too_small_fails_before_training(tmp_path, litgpt_model):
    from lightning_lowmem import MemoryBudgetError

    path = write_checkpoint(litgpt_model.state_dict(), "pth", tmp_path)
    lit = LitGPT(litgpt_model.config)
    with pytest.raises(MemoryBudgetError, match=r"cannot hold one layer.*available 4096 bytes"):
        _trainer(LowMemCallback(path, max_memory={"cpu": "4KiB"}, context=16), max_steps=2).fit(lit, _data())
    assert not getattr(lit, "optimizer_configured", False)
