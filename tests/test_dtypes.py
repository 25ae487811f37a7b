"""bf16 -> fp16 fallback: on a device without bf16, a bf16 load converts each tensor and warns naming the device."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lightning_lowmem import BF16FallbackWarning, assume_bf16_support, init_empty, load_checkpoint, supports_bf16
from lightning_lowmem.dtypes import fallback_dtype


class Small(nn.Module):
    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8, dtype=dtype)
        self.proj = nn.Linear(8, 8, dtype=dtype)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("scale", torch.linspace(0, 1, 8, dtype=dtype), persistent=False)  # like RoPE tables


def bf16_checkpoint(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in Small().state_dict().items()}
    path = tmp_path / "small.safetensors"
    save_file(state, path)
    return str(path), state


def test_bf16_load_falls_back_to_fp16_on_a_device_without_bf16(tmp_path):
    path, state = bf16_checkpoint(tmp_path)
    with init_empty():
        model = Small()
    with assume_bf16_support("cpu", False), pytest.warns(BF16FallbackWarning, match="cpu does not support bfloat16"):
        load_checkpoint(model, path, dtype=torch.bfloat16)
    assert model.proj.weight.dtype == torch.float16 and model.embed.weight.dtype == torch.float16
    assert model.steps.dtype == torch.long  # integer tensors are untouched
    assert model.scale.dtype == torch.float16  # buffers the checkpoint does not hold fall back too
    assert torch.equal(model.proj.weight, state["proj.weight"].to(torch.float16))
    assert torch.equal(model.embed.weight, state["embed.weight"].to(torch.float16))


def test_a_model_built_in_bf16_falls_back_too(tmp_path):
    path, state = bf16_checkpoint(tmp_path)
    with init_empty():
        model = Small(dtype=torch.bfloat16)
    with assume_bf16_support("cpu", False), pytest.warns(BF16FallbackWarning) as record:
        load_checkpoint(model, path)
    assert len(record) == 1  # once per device, not once per tensor
    assert {p.dtype for p in model.parameters()} == {torch.float16}


def test_no_fallback_where_bf16_is_supported_or_not_asked_for(tmp_path):
    path, state = bf16_checkpoint(tmp_path)
    with init_empty():
        model = Small()
    with warnings.catch_warnings():
        warnings.simplefilter("error", BF16FallbackWarning)
        load_checkpoint(model, path, dtype=torch.bfloat16)
        assert model.proj.weight.dtype == torch.bfloat16
        with assume_bf16_support("cpu", False):
            assert fallback_dtype(torch.float32, "cpu") == torch.float32


def test_support_override_is_scoped_and_per_device():
    assert supports_bf16("cpu")
    with assume_bf16_support("cpu", False):
        assert not supports_bf16("cpu") and not supports_bf16(torch.device("cpu"))
        with assume_bf16_support("cpu", True):
            assert supports_bf16("cpu")
        assert not supports_bf16("cpu")
    assert supports_bf16("cpu")
    with assume_bf16_support("cuda:1", False), pytest.warns(BF16FallbackWarning, match="cuda:1"):
        assert not supports_bf16("cuda:1")
        assert fallback_dtype(torch.bfloat16, "cuda:1") == torch.float16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_support_follows_the_device():
    assert supports_bf16("cuda:0") == torch.cuda.is_bf16_supported(including_emulation=False)


class Regressor(nn.Module):
    """A model that takes floating inputs, which Lightning's precision plugin casts to its own dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _regressor_checkpoint(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    state = {k: v.to(torch.bfloat16) for k, v in Regressor().state_dict().items()}
    save_file(state, tmp_path / "regressor.safetensors")
    return str(tmp_path / "regressor.safetensors"), state


def _fp16_reference(state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(x.to(torch.float16), state["proj.weight"].to(torch.float16),
                                state["proj.bias"].to(torch.float16))


def test_fabric_bf16_true_follows_the_fp16_fallback(tmp_path):
    """Fabric with precision="bf16-true" on a device without bf16: the strategy loads fp16 weights, and Fabric's
    plugin becomes "16-true" with them, so that a float input is cast to fp16, not to bf16 against fp16 weights."""
    import lightning as L

    from lightning_lowmem import LowMemStrategy

    path, state = _regressor_checkpoint(tmp_path)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    with assume_bf16_support("cpu", False), pytest.warns(BF16FallbackWarning):
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=LowMemStrategy(), precision="bf16-true")
        with fabric.init_module(empty_init=True):
            model = Regressor()
        model = fabric.setup(model)
        fabric.load(path, {"model": model})
        out = model(x)  # through Fabric's wrapper: the plugin casts the input, and the output back to float32
        plugin = fabric.strategy.precision
        assert plugin.precision == "16-true" and fabric._precision is plugin
        assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert torch.equal(out, _fp16_reference(state, x).float())


def test_the_trainer_callback_keeps_fp16_through_the_strategys_setup(tmp_path):
    """The callback loads before the Trainer's strategy converts the module to the plugin's dtype: with the plugin made
    "16-true", predict runs on the fp16 weights (not cast back to bf16) and gives the fp16 model's outputs."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_lowmem import LowMemCallback

    path, state = _regressor_checkpoint(tmp_path)

    class Lit(L.LightningModule):
        def configure_model(self):
            self.model = Regressor()

        def predict_step(self, batch):
            return self.model(batch)

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    lit = Lit()
    with assume_bf16_support("cpu", False), pytest.warns(BF16FallbackWarning):
        trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-true", callbacks=[LowMemCallback(path)],
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        out = trainer.predict(lit, DataLoader(x, batch_size=4))
    assert trainer.precision_plugin.precision == "16-true"
    assert {p.dtype for p in lit.parameters()} == {torch.float16}
    assert torch.equal(out[0], _fp16_reference(state, x))


def test_where_bf16_is_supported_the_plugin_stays_bf16_true(tmp_path):
    import lightning as L

    from lightning_lowmem import LowMemStrategy

    path, state = _regressor_checkpoint(tmp_path)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=LowMemStrategy(), precision="bf16-true")
    with fabric.init_module(empty_init=True):
        model = Regressor()
    model = fabric.setup(model)
    fabric.load(path, {"model": model})
    assert fabric.strategy.precision.precision == "bf16-true"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
