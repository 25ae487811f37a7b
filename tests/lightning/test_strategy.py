"""LowMemStrategy: Fabric(strategy="lowmem") builds on meta and streams checkpoints in."""

from __future__ import annotations

import sys

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY
from torch import nn

from lightning_lowmem import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    LowMemStrategy,
    MetaTensorError,
    UnsupportedQuantizationError,
)
from lightning_lowmem.quantize import SCHEMES

needs_nf4 = pytest.mark.skipif("bnb.nf4" not in SCHEMES, reason="the bnb.nf4 scheme is not available")
DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "32-true": torch.float32}


def _fabric(flag: str, precision: str = "bf16-true", **options) -> L.Fabric:
    strategy = "lowmem" if flag == "string" else LowMemStrategy(**options)
    return L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision)


def test_registered_on_import_and_device_from_connector():
    assert "lowmem" in STRATEGY_REGISTRY.available_strategies()
    fabric = L.Fabric(accelerator="cpu", strategy="lowmem")
    assert isinstance(fabric.strategy, LowMemStrategy)
    assert fabric.strategy.root_device == torch.device("cpu") == fabric.device
    assert fabric.strategy.parallel_devices == [torch.device("cpu")]


def test_one_device_only():
    with pytest.raises(ValueError, match="one device"):
        L.Fabric(accelerator="cpu", devices=2, strategy="lowmem")


def test_bad_options_fail_when_built():
    with pytest.raises(UnsupportedQuantizationError):
        LowMemStrategy(quantize="bnb.nf5")
    with pytest.raises(TypeError, match="dtype"):
        LowMemStrategy(dtype="bf16")


@pytest.mark.parametrize("empty_init", [None, True])
def test_init_module_is_meta_and_init_tensor_is_real(litgpt_config, empty_init):
    from litgpt import GPT

    fabric = _fabric("string")
    with fabric.init_module(empty_init=empty_init):
        model = GPT(litgpt_config)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    assert not model.cos.is_meta  # buffers computed in __init__ stay real
    with fabric.init_tensor():
        x = torch.ones(3)
    assert not x.is_meta and x.dtype == torch.bfloat16


def test_a_fresh_run_with_empty_init_false_builds_real_weights_and_trains(litgpt_config):
    from litgpt import GPT

    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="lowmem", precision="32-true")
    torch.manual_seed(0)
    with fabric.init_module(empty_init=False):
        model = GPT(litgpt_config)
    assert not any(p.is_meta for p in model.parameters())
    assert all(p.std() > 0 for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n
               and "ln" not in n)  # initialised, not empty
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    batch = torch.randint(0, litgpt_config.padded_vocab_size, (2, 9))
    losses = []
    for _ in range(5):
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_a_model_still_on_meta_at_its_first_forward_says_what_to_do(litgpt_config):
    from litgpt import GPT

    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="lowmem")
    with fabric.init_module():
        model = GPT(litgpt_config)
    model = fabric.setup(model)
    with pytest.raises(MetaTensorError, match=r"GPT's forward: \d+ tensors are still on the meta device: "
                                             r"'lm_head\.weight'.*fabric\.load_raw.*empty_init=False"):
        model(torch.randint(0, 10, (1, 4)))


@pytest.mark.parametrize("flag", ["string", "instance"])
@pytest.mark.parametrize("precision", list(DTYPES))
@pytest.mark.parametrize("setup_first", [False, True], ids=["load-then-setup", "setup-then-load"])
def test_load_raw_equals_eager(tmp_path, litgpt_model, flag, precision, setup_first, write_checkpoint, eager_gpt):
    from litgpt import GPT

    path = write_checkpoint(litgpt_model.state_dict(), "pth", tmp_path)
    fabric = _fabric(flag, precision)
    with fabric.init_module():
        model = GPT(litgpt_model.config)
    if setup_first:
        model = fabric.setup(model)  # still on meta: must not call .to() on it
        assert model.lm_head.weight.is_meta
    fabric.load_raw(path, model)
    model = model if setup_first else fabric.setup(model)

    dtype = DTYPES[precision]
    eager = eager_gpt(litgpt_model, dtype)
    for (name, ours), (_, theirs) in zip(model.state_dict().items(), eager.state_dict().items()):
        assert ours.dtype == dtype and torch.equal(ours, theirs), name
    x = torch.randint(0, 100, (2, 16))
    out = model(x)  # Fabric's precision plugin returns float32
    torch.testing.assert_close(out, eager(x).to(out.dtype), rtol=0, atol=0)
    assert fabric.strategy.reports[-1].tensors == len(litgpt_model.state_dict())


def test_dtype_option_wins_over_precision(tmp_path, litgpt_model, write_checkpoint):
    from litgpt import GPT

    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    fabric = L.Fabric(accelerator="cpu", strategy=LowMemStrategy(dtype=torch.float16))
    with fabric.init_module():
        model = GPT(litgpt_model.config)
    fabric.load_raw(path, model)
    assert {p.dtype for p in model.parameters()} == {torch.float16}


def _train_steps(fabric, model, optimizer, steps=3, same_batch=False) -> list[float]:
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        batch = torch.randint(0, 100, (4, 17), generator=torch.Generator().manual_seed(0) if same_batch else None)
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_fabric_load_restores_model_optimizer_and_counters(tmp_path, litgpt_model):
    """Save with Lightning's own strategy, resume with lowmem: same model, optimizer state, counters."""
    from litgpt import GPT

    plain = L.Fabric(accelerator="cpu", precision="32-true")
    model, optimizer = plain.setup(litgpt_model.train(), torch.optim.AdamW(litgpt_model.parameters(), lr=1e-3))
    _train_steps(plain, model, optimizer)
    plain.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer, "step": 3})

    fabric = _fabric("string", "32-true")
    with fabric.init_module():
        resumed = GPT(litgpt_model.config)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3)  # made on the meta parameters
    resumed, resumed_opt = fabric.setup(resumed, resumed_opt)
    state = {"model": resumed, "optimizer": resumed_opt, "step": 0}
    remainder = fabric.load(tmp_path / "ckpt.pt", state)

    assert state["step"] == 3 and remainder == {}
    for (name, ours), (_, theirs) in zip(resumed.state_dict().items(), model.state_dict().items()):
        assert torch.equal(ours, theirs), name
    ours_opt, theirs_opt = resumed_opt.state_dict(), optimizer.state_dict()
    for i, st in theirs_opt["state"].items():
        assert torch.equal(ours_opt["state"][i]["exp_avg"], st["exp_avg"])
    assert all(not p.is_meta for g in resumed_opt.param_groups for p in g["params"])
    # Both go on training identically: the optimizer now steps the loaded parameters.
    _train_steps(plain, model, optimizer, steps=1)
    _train_steps(fabric, resumed, resumed_opt, steps=1)
    for (name, ours), (_, theirs) in zip(resumed.state_dict().items(), model.state_dict().items()):
        torch.testing.assert_close(ours, theirs, msg=name)


def test_fabric_save_then_load(tmp_path, litgpt_model, write_checkpoint):
    from litgpt import GPT

    fabric = _fabric("string", "32-true")
    with fabric.init_module():
        model = GPT(litgpt_model.config)
    fabric.load_raw(write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path), model)
    model = fabric.setup(model)
    fabric.save(tmp_path / "saved.ckpt", {"model": model, "epoch": 7})

    saved = torch.load(tmp_path / "saved.ckpt", weights_only=True)
    assert saved["epoch"] == 7
    assert all(torch.equal(saved["model"][k], v) for k, v in litgpt_model.state_dict().items())
    with fabric.init_module():
        again = GPT(litgpt_model.config)
    assert fabric.load(tmp_path / "saved.ckpt", {"model": again}) == {"epoch": 7}
    assert all(torch.equal(again.state_dict()[k], v) for k, v in litgpt_model.state_dict().items())


def test_bad_paths_fail_with_the_loaders_errors(tmp_path, litgpt_model, write_checkpoint, tiny_config, tiny_gpt):
    from litgpt import GPT

    fabric = _fabric("string")
    with fabric.init_module():
        model = GPT(litgpt_model.config)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        fabric.load_raw(tmp_path / "nope.pth", model)
    with pytest.raises(CheckpointNotFoundError):
        fabric.load(tmp_path / "nope.ckpt", {"model": model})
    other = tiny_gpt(tiny_config(n_embd=64)).state_dict()
    with pytest.raises(CheckpointMismatchError, match="shape"):
        fabric.load_raw(write_checkpoint(other, "pth", tmp_path), model)
    assert all(p.is_meta for p in model.parameters())  # nothing was read


def test_added_lora_parameters_are_initialized(tmp_path, litgpt_model, write_checkpoint, lora_config, lora_key_map):
    from litgpt.lora import GPT as LoRAGPT
    from litgpt.lora import mark_only_lora_as_trainable

    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    fabric = L.Fabric(accelerator="cpu", strategy=LowMemStrategy(key_map=lora_key_map), precision="32-true")
    with fabric.init_module():
        model = LoRAGPT(lora_config())
    mark_only_lora_as_trainable(model)
    fabric.load_raw(path, model)  # strict: everything but the trainable adapters must be in the file


    lora_B = model.transformer.h[0].attn.qkv.lora_B
    assert not lora_B.is_meta and lora_B.requires_grad and not lora_B.any()  # LoRA's own init: B = 0
    assert model.transformer.h[0].attn.qkv.lora_A.abs().sum() > 0
    x = torch.randint(0, 100, (2, 16))
    torch.testing.assert_close(model(x), litgpt_model(x))  # B = 0: the adapter adds nothing yet


def test_missing_frozen_parameter_is_an_error_before_reading(tmp_path, litgpt_model, write_checkpoint):
    from litgpt import GPT

    state = {k: v for k, v in litgpt_model.state_dict().items() if k != "transformer.ln_f.weight"}
    fabric = _fabric("string")
    with fabric.init_module():
        model = GPT(litgpt_model.config)
    model.transformer.ln_f.weight.requires_grad_(False)
    with pytest.raises(MetaTensorError, match="ln_f.weight"):
        fabric.load_raw(write_checkpoint(state, "pth", tmp_path), model, strict=False)
    assert all(p.is_meta for p in model.parameters())


def test_strict_and_non_strict_unexpected_keys(tmp_path, litgpt_model, write_checkpoint):
    from litgpt import GPT

    state = dict(litgpt_model.state_dict(), **{"extra.weight": torch.zeros(3)})
    path = write_checkpoint(state, "safetensors", tmp_path)
    fabric = _fabric("string", "32-true")
    with fabric.init_module():
        model = GPT(litgpt_model.config)
    with pytest.raises(CheckpointMismatchError, match="extra.weight"):
        fabric.load_raw(path, model)
    assert fabric.load(path, {"model": model}, strict=False) == {}  # a bare weights file is the model's entry
    assert fabric.strategy.reports[-1].skipped == ["extra.weight"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in litgpt_model.state_dict().items())


@needs_nf4
@pytest.mark.parametrize("flag", ["options", "setup-before-load"])
def test_nf4_on_cpu_qlora_train_save_reload(tmp_path, flag, write_checkpoint, tiny_config, tiny_gpt, lora_config,
                                            lora_key_map, eager_gpt):
    """bnb.nf4 on CPU (BitsandbytesPrecision refuses CPU): quantized base frozen, LoRA trains, adapters reload."""
    from litgpt.lora import GPT as LoRAGPT
    from litgpt.lora import mark_only_lora_as_trainable

    base = tiny_gpt(tiny_config(n_embd=64))  # bnb's CPU kernel needs in_features >= 64
    path = write_checkpoint(base.state_dict(), "pth", tmp_path)

    def build():
        fabric = L.Fabric(accelerator="cpu", precision="bf16-true",
                          strategy=LowMemStrategy(quantize="bnb.nf4", key_map=lora_key_map))
        with fabric.init_module():
            model = LoRAGPT(lora_config(n_embd=64))
        mark_only_lora_as_trainable(model)
        if flag == "setup-before-load":
            model = fabric.setup_module(model)
        fabric.load_raw(path, model)
        return fabric, model if flag == "setup-before-load" else fabric.setup_module(model)

    fabric, model = build()
    assert type(model.transformer.h[0].attn.qkv.linear).__name__ == "Linear4bit"
    report = fabric.strategy.reports[-1]
    assert len(report.quantized) == 8  # 2 layers x 4 Linears; LoRA's wrapped head stays bf16, as lm_head would
    assert "lm_head.linear" in report.left_out and type(model.lm_head.linear) is torch.nn.Linear
    x = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        ours, reference = model(x).float(), eager_gpt(base, torch.bfloat16)(x).float()
    cos = torch.nn.functional.cosine_similarity(ours.flatten(), reference.flatten(), dim=0)
    assert cos > 0.98

    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2))
    losses = _train_steps(fabric, model, optimizer, steps=6, same_batch=True)
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)

    trainable = {"model": lambda name, _: "lora_" in name}
    fabric.save(tmp_path / "adapters.pt", {"model": model, "step": 6}, filter=trainable)
    model.eval()
    with torch.no_grad():
        expected = model(x)
    fabric2, again = build()
    assert fabric2.load(tmp_path / "adapters.pt", {"model": again}, strict=False) == {"step": 6}
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(x), expected, rtol=0, atol=0)


@pytest.mark.parametrize(("scheme", "stored_as"), [("bnb.nf4", "weight.quant_state.bitsandbytes__nf4"),
                                                   ("bnb.int8", "SCB"), ("torchao.int8wo", "_weight_qdata")])
def test_fabric_save_of_a_quantized_model_keeps_it_quantized(tmp_path, quant_checkpoint, quant_config, forward_logits,
                                                             scheme, stored_as):
    from litgpt import GPT

    def fabric_and_model(**options):
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=LowMemStrategy(**options), precision="bf16-true")
        with fabric.init_module():
            model = GPT(quant_config)
        return fabric, fabric.setup(model)

    fabric, model = fabric_and_model(quantize=scheme)
    fabric.load_raw(quant_checkpoint, model)
    fabric.save(tmp_path / "quantized.ckpt", {"model": model, "step": 7})
    saved = torch.load(tmp_path / "quantized.ckpt", weights_only=True)  # plain tensors and strings
    assert saved["step"] == 7 and saved["model"]["__metadata__"]["lightning_lowmem.quantize"] == scheme
    assert f"transformer.h.0.attn.qkv.{stored_as}" in saved["model"]

    fabric2, again = fabric_and_model()  # no quantize=: the file says it
    state = {"model": again, "step": 0}
    assert fabric2.load(tmp_path / "quantized.ckpt", state) == {} and state["step"] == 7
    report = fabric2.strategy.reports[-1]
    assert len(report.prequantized) == 8 and not report.requantized
    torch.testing.assert_close(forward_logits(again.eval()), forward_logits(model.eval()), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantize", [None, "bnb.nf4"])
def test_cuda_loads_straight_to_the_device(tmp_path, litgpt_model, quantize, write_checkpoint, tiny_config,
                                           tiny_gpt, eager_gpt):
    from litgpt import GPT

    base = tiny_gpt(tiny_config(n_embd=64)) if quantize else litgpt_model
    path = write_checkpoint(base.state_dict(), "safetensors", tmp_path)
    fabric = L.Fabric(accelerator="cuda", devices=1, precision="bf16-true", strategy=LowMemStrategy(quantize=quantize))
    assert fabric.strategy.root_device.type == "cuda"
    with fabric.init_module():
        model = GPT(base.config)
    fabric.load_raw(path, model)
    model = fabric.setup(model)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cuda"}
    x = torch.randint(0, 100, (2, 16), device="cuda")
    with torch.no_grad():
        ours, reference = model(x).float(), eager_gpt(base, torch.bfloat16).cuda()(x).float()
    if quantize is None:
        torch.testing.assert_close(ours, reference, rtol=0, atol=0)
    else:
        assert torch.nn.functional.cosine_similarity(ours.flatten(), reference.flatten(), dim=0) > 0.98


def test_max_memory_is_passed_to_the_placement_plan(tmp_path, litgpt_model, write_checkpoint):
    """A budget too small for one layer fails before any weight is read; one that holds the model loads it."""
    from litgpt import GPT

    from lightning_lowmem import MemoryBudgetError

    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    fabric = _fabric("instance", "32-true", max_memory={"cpu": "4KiB"}, context=16)
    with fabric.init_module():
        model = GPT(litgpt_model.config)
    with pytest.raises(MemoryBudgetError) as err:
        fabric.load_raw(path, model)
    assert err.value.needed > err.value.available == 4096
    assert all(p.is_meta for p in model.parameters())

    fabric = _fabric("instance", "32-true", max_memory={"cpu": "1GiB"}, context=16)
    with fabric.init_module():
        model = GPT(litgpt_model.config)
    fabric.load_raw(path, model)
    report = fabric.strategy.reports[-1]
    assert report.placement is not None and not report.placement.offloaded
    x = torch.randint(0, 100, (1, 8))
    torch.testing.assert_close(model.eval()(x), litgpt_model(x), rtol=0, atol=0)


def test_one_string_is_one_skip_pattern(tmp_path, litgpt_model, write_checkpoint):
    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    strategy = LowMemStrategy(quantize="bnb.int8", skip_quantize="lm_head")
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    with fabric.init_module():
        from litgpt import GPT

        model = GPT(litgpt_model.config)
    fabric.load_raw(path, model)
    assert type(model.lm_head) is nn.Linear and "lm_head" not in strategy.reports[-1].quantized
    assert "transformer.h.0.attn.qkv" in strategy.reports[-1].quantized


def test_fabric_load_raw_opens_the_file_once_and_plans_once(tmp_path, litgpt_model, write_checkpoint, monkeypatch):
    import lightning_lowmem.plan as plan_module

    path = write_checkpoint(litgpt_model.state_dict(), "pth", tmp_path)
    opens: list[str] = []
    plans: list[int] = []
    original = plan_module.make_plan

    def counting_plan(*args, **kwargs):
        plans.append(1)
        return original(*args, **kwargs)

    for name, mod in list(sys.modules.items()):
        if name.startswith("lightning_lowmem") and getattr(mod, "make_plan", None) is original:
            monkeypatch.setattr(mod, "make_plan", counting_plan)
    recording = [False]
    sys.addaudithook(lambda event, args: opens.append(str(args[0])) if event == "open" and recording[0] else None)
    strategy = LowMemStrategy()
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    with fabric.init_module():
        from litgpt import GPT

        model = GPT(litgpt_model.config)
    recording[0] = True
    fabric.load_raw(path, model)
    recording[0] = False
    assert opens.count(str(path)) <= 2 and len(plans) == 1


def test_fabric_load_does_not_torch_load_the_weights(tmp_path, litgpt_model, monkeypatch):
    path = tmp_path / "fabric.ckpt"
    torch.save({"model": litgpt_model.state_dict(), "step": 3}, path)
    calls = []
    original = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(kw) or original(*a, **kw))
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="lowmem")
    with fabric.init_module():
        from litgpt import GPT

        model = GPT(litgpt_model.config)
    rest = fabric.load(path, {"model": model})
    assert rest == {"step": 3}
    assert not any(kw.get("mmap") for kw in calls) and len(calls) <= 1


def test_fabric_save_never_writes_through_a_link_at_its_name(tmp_path, mount_tmpfs, litgpt_model):
    """The file is written beside its name and renamed over it: a link there is replaced, its target left as it was.
    The directory is on another file system than the system's temporary directory, where Lightning's own writer
    copies its temporary file over the name, through the link."""
    disk = mount_tmpfs("4m")
    victim = tmp_path / "victim.ckpt"
    victim.write_bytes(b"precious")
    (disk / "saved.ckpt").symlink_to(victim)
    fabric = _fabric("string", "32-true")
    model = fabric.setup(litgpt_model)
    fabric.save(disk / "saved.ckpt", {"model": model, "epoch": 3})
    assert victim.read_bytes() == b"precious" and not (disk / "saved.ckpt").is_symlink()
    assert torch.load(disk / "saved.ckpt", weights_only=True)["epoch"] == 3
    assert sorted(p.name for p in disk.iterdir()) == ["saved.ckpt"]


def test_fabric_save_on_a_full_disk_is_a_save_error_and_the_old_file_stays(mount_tmpfs, fill_disk, litgpt_model):
    from lightning_lowmem import SaveError

    disk = mount_tmpfs("1m")
    fabric = _fabric("string", "32-true")
    model = fabric.setup(litgpt_model)
    fabric.save(disk / "saved.ckpt", {"model": model, "epoch": 1})
    before = (disk / "saved.ckpt").read_bytes()
    fill_disk(disk)
    with pytest.raises(SaveError, match=r"Writing .*saved.ckpt failed at .*: No space left on device\. .* holds what "
                                        r"it held before and no temporary file is left\. 0 B is free") as e:
        fabric.save(disk / "saved.ckpt", {"model": model, "epoch": 2})
    assert e.value.errno == 28 and e.value.path == str(disk / "saved.ckpt")
    assert (disk / "saved.ckpt").read_bytes() == before
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "saved.ckpt"]


def _fabric_with_layers_on_disk(tmp_path, tiny_config, tiny_gpt, write_checkpoint):
    """A 6-layer GPT loaded by Fabric with a CPU budget of a quarter of it and the rest on disk: ``(reference, path,
    fabric, model)``, the model not yet set up."""
    from litgpt import GPT

    reference = tiny_gpt(tiny_config(n_layer=6), std=0.3)
    path = write_checkpoint(reference.state_dict(), "safetensors", tmp_path)
    nbytes = sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    fabric = _fabric("instance", "32-true", max_memory={"cpu": nbytes // 4}, disk_offload=True)
    with fabric.init_module():
        model = GPT(reference.config)
    fabric.load_raw(path, model)
    return reference, path, fabric, model


def test_fabric_with_layers_on_disk_runs_inference_and_refuses_an_optimizer(tmp_path, tiny_config, tiny_gpt,
                                                                           write_checkpoint):
    from litgpt import GPT

    reference, path, fabric, model = _fabric_with_layers_on_disk(tmp_path, tiny_config, tiny_gpt, write_checkpoint)
    model = fabric.setup(model)  # moving the model leaves the layers on disk alone
    report = fabric.strategy.reports[-1]
    assert report.placement.on_disk and report.disk is not None
    x = torch.randint(0, 100, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), reference(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="Training through them is not supported"):
        fabric.setup_optimizers(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
    report.disk.close()

    fabric_file = write_checkpoint(reference.state_dict(), "fabric", tmp_path / "fabric")  # {"model": ..., "step": 3}
    with fabric.init_module():
        model = GPT(reference.config)
    assert fabric.load(fabric_file, {"model": model}) == {"step": 3}
    with torch.no_grad():  # the file fabric.load opened stays open for the layers on disk
        torch.testing.assert_close(model.eval()(x), reference(x), rtol=0, atol=0)
    fabric.strategy.reports[-1].disk.close()


def test_fabric_save_of_a_model_with_layers_on_disk_is_refused_and_writes_nothing(tmp_path, tiny_config, tiny_gpt,
                                                                                    write_checkpoint):
    """Its layers on disk hold placeholders between forwards: fabric.save would write them as weights."""
    reference, path, fabric, model = _fabric_with_layers_on_disk(tmp_path, tiny_config, tiny_gpt, write_checkpoint)
    model = fabric.setup(model)
    for state in ({"model": model, "step": 1}, {"model": model.module}):
        with pytest.raises(ValueError, match=r"disk_offload.*nothing was written") as raised:
            fabric.save(tmp_path / "saved.ckpt", state)
        assert str(path) in str(raised.value)
    assert not (tmp_path / "saved.ckpt").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".lowmem")] == []
    fabric.strategy.reports[-1].disk.close()


_NESTED_LOAD = """
import json, os, sys, threading, time
import lightning as L, psutil, torch
from lightning_lowmem import MemoryMonitor
path, depth, bound = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fabric = L.Fabric(accelerator="cpu", devices=1, strategy="lowmem")
with fabric.init_module():
    layer = torch.nn.Linear(4, 4)
process = psutil.Process()
start = process.memory_info().rss
def watch():  # a load that would exhaust memory ends here instead
    while process.memory_info().rss - start < 4 * bound:
        time.sleep(0.005)
    os._exit(3)
threading.Thread(target=watch, daemon=True).start()
with MemoryMonitor() as monitor:
    rest = fabric.load(path, {"model": layer})
x, shared = rest["extra"], True
for _ in range(depth):
    shared &= x[0] is x[1]
    x = x[0]
print(json.dumps({"peak": monitor.usage.rss_peak_delta, "shared": shared, "leaf": repr(x[0])[:40]}))
"""


@pytest.mark.parametrize("leaf, depth", [("tensor", 14), ("int", 40)])
def test_fabric_load_of_an_entry_nested_on_itself_is_bounded_by_the_file(tmp_path, child_env, leaf, depth):
    """``x = [x, x]`` nested 14 times on a 16 Ki-element tensor (a 67 KiB file) took +1 GiB, rebuilt path by path
    (16,384 tensors); 40 levels of ints (2.5 KB) exhausted memory. Rebuilt as pickle built it (each object once),
    both take a few MiB; the bound leaves 64 MiB."""
    import json
    import subprocess

    bound = 64 * 2**20
    x = [torch.ones(16384) if leaf == "tensor" else 7]
    for _ in range(depth):
        x = [x, x]
    path = tmp_path / "nested.ckpt"
    torch.save({"model": nn.Linear(4, 4).state_dict(), "extra": x}, path)
    assert path.stat().st_size < 70_000
    proc = subprocess.run([sys.executable, "-c", _NESTED_LOAD, str(path), str(depth), str(bound)],
                          capture_output=True, text=True, env=child_env, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode} (3: past 4x the bound): {proc.stderr[-2000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["peak"] < bound and result["shared"]
    assert result["leaf"].startswith("tensor([1., 1." if leaf == "tensor" else "7")
