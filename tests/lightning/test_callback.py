"""LowMemCallback: the Trainer builds the model on meta in configure_model and streams the checkpoint in."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_lowmem import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    LowMemCallback,
    UnsupportedQuantizationError,
)
from lightning_lowmem.quantize import SCHEMES

NF4 = pytest.param("bnb.nf4", marks=pytest.mark.skipif("bnb.nf4" not in SCHEMES,
                                                       reason="the bnb.nf4 scheme is not available"))


def _trainer(callback: LowMemCallback, precision: str = "32-true", **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, precision=precision, callbacks=[callback], logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def _data(rows: int = 4, length: int = 17) -> DataLoader:
    return DataLoader(torch.randint(0, 100, (rows, length), generator=torch.Generator().manual_seed(0)), batch_size=4)


@pytest.mark.parametrize("kind", ["pth", "safetensors", "lightning-ckpt"])
@pytest.mark.parametrize("precision", ["bf16-true", "32-true"])
def test_predict_equals_eager(tmp_path, litgpt_model, kind, precision, write_checkpoint, lit_module, eager_gpt):
    """Keys of the wrapped model (lit_model.pth) and of the LightningModule (.ckpt) both load."""
    state = litgpt_model.state_dict()
    if kind == "lightning-ckpt":
        path = write_checkpoint({f"model.{k}": v for k, v in state.items()}, "lightning", tmp_path)
    else:
        path = write_checkpoint(state, kind, tmp_path)
    lit = lit_module(litgpt_model.config)
    callback = LowMemCallback(path)
    out = _trainer(callback, precision).predict(lit, _data())

    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert {p.dtype for p in lit.model.parameters()} == {dtype}
    expected = eager_gpt(litgpt_model, dtype)(next(iter(_data())))
    torch.testing.assert_close(out[0], expected, rtol=0, atol=0)
    assert callback.report.tensors == len(state)
    assert ("model." in callback.report.key_note) == (kind != "lightning-ckpt")


def test_validate_and_test(tmp_path, litgpt_model, write_checkpoint, lit_module, eager_gpt):
    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    lit = lit_module(litgpt_model.config)
    trainer = _trainer(LowMemCallback(path))
    val = trainer.validate(lit, _data())[0]["val_loss"]
    test = trainer.test(lit, _data())[0]["test_loss"]

    batch = next(iter(_data()))
    logits = eager_gpt(litgpt_model, torch.float32)(batch[:, :-1])
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)).item()
    assert val == pytest.approx(expected, rel=1e-6) and test == pytest.approx(expected, rel=1e-6)


def test_model_built_in_init_warns_and_still_loads(tmp_path, litgpt_model, write_checkpoint, lit_module, eager_gpt):
    path = write_checkpoint(litgpt_model.state_dict(), "pth", tmp_path)
    torch.manual_seed(123)
    lit = lit_module(litgpt_model.config, build_in_init=True)
    with pytest.warns(UserWarning, match="already holds .* allocated parameters"):
        out = _trainer(LowMemCallback(path)).predict(lit, _data())
    torch.testing.assert_close(out[0], eager_gpt(litgpt_model, torch.float32)(next(iter(_data()))), rtol=0, atol=0)


def test_bad_checkpoints_fail_before_training(tmp_path, litgpt_model, write_checkpoint, tiny_config, tiny_gpt,
                                              lit_module):
    lit = lit_module(litgpt_model.config)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        _trainer(LowMemCallback(tmp_path / "missing" / "lit_model.pth"), max_steps=2).fit(lit, _data())
    other = write_checkpoint(tiny_gpt(tiny_config(n_layer=3)).state_dict(), "pth", tmp_path / "three-layers")
    lit = lit_module(litgpt_model.config)
    with pytest.raises(CheckpointMismatchError, match="transformer.h.2"):
        _trainer(LowMemCallback(other), max_steps=2).fit(lit, _data())
    assert lit.losses == [] and not lit.optimizer_configured
    assert all(p.is_meta for p in lit.model.parameters())  # nothing was read


def test_bad_options_fail_when_built():
    with pytest.raises(UnsupportedQuantizationError):
        LowMemCallback("x.pth", quantize="int3")


@pytest.mark.parametrize("quantize", [None, NF4])
def test_qlora_fit_predict_save_and_reload(tmp_path, quantize, write_checkpoint, tiny_config, tiny_gpt, lora_config,
                                           lora_key_map, lit_module):
    """Frozen (quantized) base, trainable LoRA adapters: loss goes down, base unchanged, adapters reload."""
    # n_embd >= 64: bitsandbytes' CPU inference kernel needs in_features >= its 64-weight blocks.
    path = write_checkpoint(tiny_gpt(tiny_config(n_embd=64)).state_dict(), "pth", tmp_path)
    options = dict(quantize=quantize, key_map=lambda k: "model." + lora_key_map(k))
    lit = lit_module(lora_config(n_embd=64), lora=True)
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

    again = lit_module(lora_config(n_embd=64), lora=True)
    out = _trainer(LowMemCallback(path, **options), "bf16-true").predict(again, _data(),
                                                                          ckpt_path=tmp_path / "adapter.ckpt")
    torch.testing.assert_close(out[0], predicted, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_predict_equals_eager(tmp_path, litgpt_model, write_checkpoint, lit_module, eager_gpt):
    path = write_checkpoint(litgpt_model.state_dict(), "pth", tmp_path)
    lit = lit_module(litgpt_model.config)
    trainer = L.Trainer(accelerator="cuda", devices=1, precision="bf16-true", callbacks=[LowMemCallback(path)],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    out = trainer.predict(lit, _data())
    expected = eager_gpt(litgpt_model, torch.bfloat16).cuda()(next(iter(_data())).cuda())
    torch.testing.assert_close(out[0].cuda(), expected, rtol=0, atol=0)


def test_max_memory_too_small_fails_before_training(tmp_path, litgpt_model, write_checkpoint, lit_module):
    from lightning_lowmem import MemoryBudgetError

    path = write_checkpoint(litgpt_model.state_dict(), "pth", tmp_path)
    lit = lit_module(litgpt_model.config)
    with pytest.raises(MemoryBudgetError, match=r"cannot hold one layer.*available 4096 bytes"):
        _trainer(LowMemCallback(path, max_memory={"cpu": "4KiB"}, context=16), max_steps=2).fit(lit, _data())
    assert not getattr(lit, "optimizer_configured", False)


def test_trainer_model_to_device_leaves_the_offloaded_layers_on_the_host(tiny_config, tiny_gpt):
    """Lightning's SingleDeviceStrategy.setup calls model_to_device(): the whole model, offloaded layers too.

    The strategy is given the meta device as its root so that every tensor it moves is visible (a CPU-only
    machine has no second real device); LowMemCallback patches model_to_device the same way for CUDA.
    """
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from lightning_lowmem import layer_offload
    from lightning_lowmem.lightning.callback import _keep_offloaded_on_host

    offloaded_names = ("transformer.h.1.", "transformer.h.2.")
    for guarded in (False, True):
        model = tiny_gpt(tiny_config(n_layer=4))
        handle = layer_offload(model, "cpu", layers=["transformer.h.1", "transformer.h.2"])
        strategy = SingleDeviceStrategy(device=torch.device("meta"))
        strategy.model = model
        if guarded:
            _keep_offloaded_on_host(strategy, handle)
        strategy.model_to_device()
        on_host = {n for n, p in model.named_parameters() if not p.is_meta}
        if guarded:
            assert on_host == {n for n, _ in model.named_parameters() if n.startswith(offloaded_names)}
            assert handle.weights["transformer.h.1"].masters[0].device.type == "cpu"
        else:
            assert on_host == set()  # Lightning's own move takes every layer to the device


TRAINER_FSDP = """
import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy
from litgpt import GPT
from lightning_lowmem import LowMemCallback
from lightning_lowmem.placement import shard_model

class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model, self.losses = None, []

    def configure_model(self):
        if self.model is None:  # built on meta by the callback, sharded here, loaded by the callback
            self.model = shard_model(GPT(config()), self.device_mesh)

    def training_step(self, batch, batch_idx):
        logits = self.model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

data = torch.utils.data.DataLoader(torch.randint(0, 101, (8, 17), generator=torch.Generator().manual_seed(0)),
                                   batch_size=2)
callback = LowMemCallback(args["path"])
trainer = L.Trainer(accelerator="cpu", devices=world, precision="bf16-true", max_steps=4, callbacks=[callback],
                    strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1), logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
module = Lit()
trainer.fit(module, data)
emit(losses=module.losses, bytes_read=callback.report.bytes_read, shard_bytes=callback.report.shard_bytes,
     sharded=all(type(p).__name__ == "DTensor" for p in module.model.parameters()), rope=str(module.model.cos.dtype))
"""


@pytest.mark.slow
def test_model_parallel_trainer_loads_each_ranks_shard(run_ranks, shard_config, tiny_gpt, write_checkpoint,
                                                       tmp_path):
    """Lightning's own ModelParallelStrategy (FSDP2, 2 ranks on CPU): configure_model shards the model built on
    meta; the callback then streams each rank's rows into its shards, and nothing is left for the strategy's
    to_empty + reset_parameters."""
    from litgpt import Config

    state = tiny_gpt(Config(**shard_config), torch.bfloat16).state_dict()
    path = write_checkpoint(state, "safetensors", tmp_path)
    ranks = run_ranks(TRAINER_FSDP, dict(config=shard_config, path=str(path)), init=False, timeout=400)
    total = sum(v.nbytes for v in state.values())
    for result in ranks:
        assert result.returncode == 0, result.stderr[-3000:]
        got = result.values
        assert got["sharded"] and got["losses"][-1] < got["losses"][0]
        # the Trainer materializes (reset_parameters: float32 RoPE) before its bf16-true conversion: bf16 tables, as
        # without the library (tests/test_eager.py compares the two)
        assert got["rope"] == "torch.bfloat16"
        assert got["bytes_read"] < 0.51 * total  # its own rows: half the file (the vocabulary splits 51 + 50)
    assert sum(r.values["bytes_read"] for r in ranks) == total


def test_predict_and_validate_with_layers_on_disk_equal_the_model_in_memory_and_fit_is_refused(
        tmp_path, tiny_config, tiny_gpt, write_checkpoint, lit_module, eager_gpt):
    reference = tiny_gpt(tiny_config(n_layer=6), std=0.3)
    path = write_checkpoint(reference.state_dict(), "safetensors", tmp_path)
    nbytes = sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    lit = lit_module(reference.config)
    callback = LowMemCallback(path, max_memory={"cpu": nbytes // 4}, disk_offload=True)
    trainer = _trainer(callback)
    out = trainer.predict(lit, _data())
    assert callback.report.placement.on_disk and callback.report.disk is not None
    batch = next(iter(_data()))
    # float32's tolerance: while a read runs, the layers compute on one thread fewer (another reduction order)
    torch.testing.assert_close(out[0], reference(batch))
    val = trainer.validate(lit, _data())[0]["val_loss"]  # the same model, its layers on disk read again
    logits = reference(batch[:, :-1])
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
    assert val == pytest.approx(expected.item(), rel=1e-6)
    with pytest.raises(ValueError, match="trainer.fit cannot train through them"):
        _trainer(LowMemCallback(path, max_memory={"cpu": nbytes // 4}, disk_offload=True),
                 max_steps=1).fit(lit_module(reference.config), _data())
    callback.report.disk.close()


@pytest.mark.parametrize("save_frozen", [True, False])
def test_a_trainer_checkpoint_of_a_model_with_layers_on_disk_is_refused_and_writes_nothing(
        tmp_path, tiny_config, tiny_gpt, write_checkpoint, lit_module, save_frozen):
    """Its layers on disk hold placeholders between forwards. save_frozen=True would write them as weights; with
    save_frozen=False the frozen weights are left out, but the model's state_dict() is refused all the same."""
    reference = tiny_gpt(tiny_config(n_layer=6), std=0.3)
    path = write_checkpoint(reference.state_dict(), "safetensors", tmp_path)
    nbytes = sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    callback = LowMemCallback(path, max_memory={"cpu": nbytes // 4}, disk_offload=True, save_frozen=save_frozen)
    trainer = _trainer(callback)
    trainer.predict(lit_module(reference.config), _data())
    assert callback.report.placement.on_disk
    with pytest.raises(ValueError, match=r"disk_offload.*nothing was written") as raised:
        trainer.save_checkpoint(tmp_path / "saved.ckpt")
    assert str(path) in str(raised.value) and not (tmp_path / "saved.ckpt").exists()
    callback.report.disk.close()


_LINES = """
import logging, sys, torch, lightning as L
from litgpt import GPT, Config
from lightning_lowmem import LowMemCallback, LowMemStrategy, init_empty

directory, quiet = sys.argv[1], sys.argv[2] == "quiet"
if quiet:  # the switches Lightning documents for its own lines
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
config = Config.from_file(directory + "/model_config.yaml")


class Lit(L.LightningModule):
    def configure_model(self):
        self.model = GPT(config)

    def predict_step(self, batch):
        return self.model(batch)


trainer = L.Trainer(accelerator="cpu", precision="bf16-true", logger=False, enable_progress_bar=False,
                    callbacks=[LowMemCallback(directory + "/lit_model.pth", quantize="bnb.nf4")])
trainer.predict(Lit(), torch.utils.data.DataLoader(torch.randint(0, 100, (2, 8)), batch_size=2))
print("-- fabric --", file=sys.stderr, flush=True)
fabric = L.Fabric(accelerator="cpu", devices=1, strategy=LowMemStrategy(), precision="bf16-true")
with fabric.init_module():
    model = GPT(config)
fabric.load_raw(directory + "/lit_model.pth", model)
"""


@pytest.mark.slow
def test_the_trainer_and_fabric_show_one_line_per_load_as_their_own_lines_and_quiet_it_with_them(
        tmp_path, child_env, tiny_config, write_litgpt_dir):
    """In a fresh process, as a user runs it: the callback's line among the Trainer's own ("GPU available: ..."),
    the strategy's after Fabric's; with Lightning's loggers set to WARNING, neither (nor Lightning's own)."""
    import re
    import subprocess
    import sys

    directory = write_litgpt_dir(tmp_path / "tiny", tiny_config(n_embd=128), torch.bfloat16, tokenizer=False)
    shown, quiet = (subprocess.run([sys.executable, "-c", _LINES, str(directory), mode], capture_output=True,
                                   text=True, env=child_env, timeout=300) for mode in ("default", "quiet"))
    assert shown.returncode == 0 and quiet.returncode == 0, shown.stderr[-2000:] + quiet.stderr[-2000:]
    trainer, fabric = shown.stderr.split("-- fabric --")
    number = r"\d+(\.\d+)? [KMG]?i?B"
    line = rf"loaded \d+ tensors from lit_model.pth{{}}: {number} read, {number} in the model, \d+\.\d+ s, " \
           rf"peak RSS \+{number}\n"
    assert "GPU available" in trainer and re.search("^LowMemCallback: " + line.format(r" \(bnb.nf4\)"), trainer, re.M)
    assert len(re.findall("LowMemCallback: loaded", trainer)) == 1, trainer
    assert re.search("^LowMemStrategy: " + line.format(""), fabric, re.M) and fabric.count("loaded ") == 1, fabric
    assert "GPU available" not in quiet.stderr and "loaded " not in quiet.stderr, quiet.stderr
